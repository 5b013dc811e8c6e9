"""Operator graphs of PyTorch models: what runs, in which order, at what cost.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.graph import trace_graph
    >>> trace_graph(nn.Linear(4, 2), torch.randn(3, 4)).ops["fwd_flops"].tolist()
    [54]
"""

from qsync_lab.graph.buckets import bucket_assignment, ddp_buckets
from qsync_lab.graph.calls import ScopedCalls
from qsync_lab.graph.fx_tracer import symbolic_trace
from qsync_lab.graph.opgraph import OpGraph, TracingFallbackWarning, trace_graph

__all__ = ["OpGraph", "ScopedCalls", "TracingFallbackWarning", "bucket_assignment", "ddp_buckets",
           "symbolic_trace", "trace_graph"]
