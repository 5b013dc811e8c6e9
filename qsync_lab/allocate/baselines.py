"""The strategies QSync compares against, with :func:`~qsync_lab.allocate.allocate`'s interface.

* :func:`uniform_low_precision`: every candidate op of each kind that cannot keep up in
  its narrowest precision (QSync's ``--tbitwidth 8``: linear/conv int8, matmul,
  embedding and the norms the indicator scores fp16); the other kinds fp32.
* :func:`dynamic_batching`: everything fp32; per-rank batch proportional to the rank's
  fp32 speed, the global batch fixed (QSync's ``DBFixedSampler``).
* :func:`joint_batch_precision`: beyond QSync, a search over batch splits between the
  cluster's own and dynamic batching's, running :func:`allocate` on each and keeping the
  plan of least summed indicator that meets the same constraints.

Example::

    >>> import pandas as pd
    >>> import torch, torch.nn as nn
    >>> from qsync_lab.cluster import load_cluster
    >>> from qsync_lab.costs import CostModel
    >>> from qsync_lab.graph import trace_graph
    >>> graph = trace_graph(nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()), torch.randn(4, 1024))
    >>> plan = dynamic_batching(graph, load_cluster("v100-t4-small"), CostModel(), None)
    >>> plan.batch_sizes   # the V100s take more of the global batch of 128
    (51, 51, 13, 13)
"""

import dataclasses
from collections.abc import Sequence

import numpy as np
import pandas as pd

from qsync_lab.allocate.choices import op_choices
from qsync_lab.constraints import Constraints
from qsync_lab.optimizers import DEFAULT_OPTIMIZER
from qsync_lab.simulate import PlanEvaluator
from qsync_lab.allocate.qsync import (allocate_detailed, kinds_to_allocate, prepared_graph,
                                     target_iteration_us)
from qsync_lab.cluster import Cluster
from qsync_lab.costs import CostModel
from qsync_lab.errors import QSyncError
from qsync_lab.graph import OpGraph
from qsync_lab.plan import Plan
from qsync_lab.simulate import PreparedGraph

__all__ = ["balanced_batch_sizes", "dynamic_batching", "joint_batch_precision",
           "uniform_low_precision", "with_batch_sizes"]

_US_PER_S = 1e6
_SPEED_ROUNDS = 2
_JOINT_STEPS = 6


def uniform_low_precision(graph: "OpGraph | PreparedGraph", cluster: Cluster, costs: CostModel,
                          indicator: pd.DataFrame, constraints: Constraints | None = None, *,
                          optimizer: str = DEFAULT_OPTIMIZER, compression=None) -> Plan:
    """Every candidate of each kind that cannot keep up in its narrowest precision."""
    prepared = prepared_graph(graph)
    constraints = constraints or Constraints()
    evaluator = PlanEvaluator(prepared, cluster, costs, optimizer=optimizer,
                              compression=compression)
    budgets = {k: constraints.memory_budget_bytes(cluster, k) for k in cluster.device_kinds}
    target_us = target_iteration_us(evaluator, constraints)
    precisions = {}
    for kind in kinds_to_allocate(evaluator, target_us, budgets):
        choices = op_choices(prepared.work, indicator, evaluator.devices[kind])
        precisions[kind] = {prepared.work.names[op]: min(ladder, key=lambda p: p.bits)
                            for op, ladder in zip(choices.ops, choices.ladders)}
    return Plan.build(prepared.graph, cluster, precisions, strategy="uniform-low",
                      optimizer=optimizer, compression=compression, constraints=constraints)


def dynamic_batching(graph: "OpGraph | PreparedGraph", cluster: Cluster, costs: CostModel,
                     indicator: pd.DataFrame | None, constraints: Constraints | None = None, *,
                     optimizer: str = DEFAULT_OPTIMIZER, compression=None) -> Plan:
    """All fp32, per-rank batch proportional to fp32 speed (``indicator`` is unused)."""
    prepared = prepared_graph(graph)
    batches = balanced_batch_sizes(prepared, cluster, costs, optimizer=optimizer,
                                   compression=compression)
    return Plan.build(prepared.graph, with_batch_sizes(cluster, batches), {},
                      strategy="dynamic-batching", optimizer=optimizer, compression=compression,
                      constraints=constraints or Constraints())


def joint_batch_precision(graph: "OpGraph | PreparedGraph", cluster: Cluster, costs: CostModel,
                          indicator: pd.DataFrame, constraints: Constraints | None = None, *,
                          optimizer: str = DEFAULT_OPTIMIZER, compression=None) -> Plan:
    """The least-risk plan over batch splits from the cluster's to dynamic batching's.

    The throughput floor is fixed on ``cluster`` as given: the explicit target, or what
    :func:`~qsync_lab.allocate.allocate` reaches on the cluster's own split (the default
    pace — its fastest kind at fp32 — or, where the slow kinds cannot keep up even in their
    fastest plan, their best). Every split is allocated against it; ties in risk go to the
    higher throughput.

    Raises:
        QSyncError: no split meets the constraints.
    """
    prepared = prepared_graph(graph)
    constraints = constraints or Constraints()
    floor = constraints.throughput_samples_per_s
    if floor is None:
        own = allocate_detailed(prepared, cluster, costs, indicator, constraints,
                                optimizer=optimizer, compression=compression)
        floor = cluster.global_batch_size * _US_PER_S / own.target_us
    fixed = dataclasses.replace(constraints, throughput_samples_per_s=floor)
    own = np.array([r.batch_size for r in cluster.ranks], float)
    balanced = np.array(balanced_batch_sizes(prepared, cluster, costs, optimizer=optimizer,
                                             compression=compression), float)
    best, best_key, errors = None, None, []
    for weight in np.linspace(0.0, 1.0, _JOINT_STEPS):
        batches = _rounded((1 - weight) * own + weight * balanced, cluster.global_batch_size)
        split = with_batch_sizes(cluster, batches)
        try:
            result = allocate_detailed(prepared, split, costs, indicator, fixed,
                                       optimizer=optimizer, compression=compression,
                                       strategy="joint")
        except QSyncError as err:
            errors.append(str(err))
            continue
        key = (sum(result.risk.values()), result.iteration_us)
        if best_key is None or key < best_key:
            best, best_key = result.plan, key
    if best is None:
        raise QSyncError(f"no batch split meets the constraints ({errors[0]})")
    return dataclasses.replace(best, constraints=constraints.for_cluster(cluster))


def balanced_batch_sizes(prepared: PreparedGraph, cluster: Cluster, costs: CostModel, *,
                         optimizer: str = DEFAULT_OPTIMIZER,
                         compression=None) -> tuple[int, ...]:
    """Per-rank batch sizes proportional to each rank's fp32 samples per second, summing to
    the cluster's global batch (speeds re-measured once at the new sizes)."""
    batches = tuple(r.batch_size for r in cluster.ranks)
    for _ in range(_SPEED_ROUNDS):
        evaluator = PlanEvaluator(prepared, with_batch_sizes(cluster, batches), costs,
                                  optimizer=optimizer)
        speed = {(name, batch): batch / line.backward_end_us for (name, batch), line in
                 zip(evaluator.classes, evaluator.timelines)}
        per_rank = np.array([speed[(r.device, b)] for r, b in zip(cluster.ranks, batches)])
        batches = _rounded(cluster.global_batch_size * per_rank / per_rank.sum(),
                           cluster.global_batch_size)
    return batches


def with_batch_sizes(cluster: Cluster, batches: Sequence[int]) -> Cluster:
    """``cluster`` with per-rank batch sizes ``batches``."""
    if len(batches) != cluster.world_size:
        raise QSyncError(f"{len(batches)} batch sizes for {cluster.world_size} ranks")
    return dataclasses.replace(cluster, ranks=tuple(
        dataclasses.replace(r, batch_size=int(b)) for r, b in zip(cluster.ranks, batches)))


def _rounded(shares: np.ndarray, total: int) -> tuple[int, ...]:
    """Integers >= 1 summing to ``total``, nearest to ``shares`` (largest remainders;
    ranks with equal shares get equal sizes where the total allows)."""
    floors = np.maximum(np.floor(shares), 1).astype(int)
    left = total - int(floors.sum())
    order = np.argsort(-(shares - floors), kind="stable")
    for i in order[:max(left, 0)]:
        floors[i] += 1
    for i in order[::-1][:max(-left, 0)]:
        floors[i] -= 1
    return tuple(int(b) for b in floors)
