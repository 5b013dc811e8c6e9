"""``Plan``: the frozen, versioned result of an allocation, as one JSON file.

A plan says, for one model on one cluster, which batch size every rank runs, how every
planned op computes on each device kind (forward and backward precision, rounding,
granularity: :class:`~qsync_lab.policy.OpPrecision`), which optimizer the run uses (the
memory model counts its state), how gradients are compressed, and what it was made under:
its strategy (with the optimizer and compression, its settings) and the constraints
(:class:`~qsync_lab.constraints.Constraints`: per-kind memory budgets, the throughput
target; ``None`` in a file written before plans recorded them). It carries the cluster's
definition, not a path, so it can be moved to the cluster it is for. Every command and
function that takes a plan takes this file.

* :mod:`~qsync_lab.plan.core`: :class:`Plan`, built, checked against a model and a
  cluster, saved atomically and loaded;
* :mod:`~qsync_lab.plan.fields`: :class:`RankPlan` and the checks of single fields;
* :mod:`~qsync_lab.plan.document`: the JSON document, written and checked in full on load;
* :mod:`~qsync_lab.plan.migrate`: version-1 documents read in version-2 form
  (:class:`PlanMigrationWarning` says what was filled in).

Example::

    >>> import tempfile, pathlib
    >>> import torch, torch.nn as nn
    >>> from qsync_lab.cluster import load_cluster
    >>> from qsync_lab.graph import trace_graph
    >>> graph = trace_graph(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(2, 8))
    >>> plan = Plan.build(graph, load_cluster("local-hybrid"), {"T4": {"0": "fp16"}},
    ...                   strategy="manual", optimizer="adamw")
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "plan.json"
    >>> plan.save(path)
    >>> Plan.load(path, graph=graph) == plan
    True
    >>> str(plan.precisions["T4"]["0"]), plan.cluster.name, plan.optimizer
    ('fp16/fp16 nearest tensor', 'local-hybrid', 'adamw')
"""

from qsync_lab.plan.core import Plan
from qsync_lab.plan.document import PLAN_TYPE, SCHEMA_VERSION
from qsync_lab.plan.fields import RankPlan
from qsync_lab.plan.migrate import PlanMigrationWarning

__all__ = ["PLAN_TYPE", "SCHEMA_VERSION", "Plan", "PlanMigrationWarning", "RankPlan"]
