"""Timeline simulation of one hybrid DDP training iteration under a precision plan.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.cluster import load_cluster
    >>> from qsync_lab.costs import CostModel
    >>> from qsync_lab.graph import trace_graph
    >>> from qsync_lab.simulate import simulate
    >>> graph = trace_graph(nn.Sequential(nn.Linear(32, 32), nn.ReLU()), torch.randn(4, 32))
    >>> sim = simulate(graph, {"T4": {"0": "fp16"}}, load_cluster("v100-t4-small"), CostModel())
    >>> sim.rank_summary()["device"].tolist()
    ['V100-SXM2-32GB', 'V100-SXM2-32GB', 'T4', 'T4']
"""

from qsync_lab.simulate.events import EVENT_COLUMNS, StreamEvents
from qsync_lab.simulate.memory import MEMORY_COMPONENTS, memory_breakdown
from qsync_lab.simulate.prepare import PreparedGraph, prepare_graph
from qsync_lab.simulate.result import STREAMS, SimResult
from qsync_lab.simulate.schedule import ComputeTimeline, compute_timeline
from qsync_lab.simulate.evaluator import PlanEvaluator, Proposal
from qsync_lab.simulate.simulator import render, simulate
from qsync_lab.simulate.sync import replay_allreduces, shares_cores

__all__ = [
    "EVENT_COLUMNS", "MEMORY_COMPONENTS", "STREAMS", "ComputeTimeline", "PlanEvaluator",
    "PreparedGraph", "Proposal", "SimResult", "StreamEvents", "compute_timeline",
    "memory_breakdown", "prepare_graph", "render", "replay_allreduces", "shares_cores",
    "simulate",
]
