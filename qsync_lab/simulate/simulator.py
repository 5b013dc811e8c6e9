"""``simulate``: replay one DDP training iteration of a hybrid cluster under a precision plan.

Per rank there is a compute stream and a communication stream:

1. The compute stream runs forward, casts and backward back to back
   (:mod:`qsync_lab.simulate.schedule`) with DDP's own work on several ranks
   (:mod:`qsync_lab.simulate.sync`): the buffer broadcast from rank 0 before the forward
   (``broadcast_buffers=True``, DDP's default) and each gradient bucket's pack.
2. The communication stream runs one ring allreduce per DDP gradient bucket, in DDP's
   steady-state bucket order (:func:`qsync_lab.graph.ddp_buckets`). Bucket ``k`` starts
   once *every* rank has packed it and allreduce ``k-1`` has ended, so the slowest rank
   gates every allreduce; its duration is the ring cost over the slowest link of the ring
   (ranks in rank order). The last buckets overlap with backward, except on CPU ranks,
   whose collectives run on the cores that compute and delay the compute stream.
3. After its backward and the last allreduce, each rank copies the averaged buckets back
   (``ddp:unpack``) and runs the optimizer step. The iteration ends when the last rank's
   step ends.

Ranks with the same device kind and batch size share one compute timeline (the plan is
per device kind), so the cost grows with the number of such classes plus a linear pass
over the ranks. The timelines, the replay and the memory come from a
:class:`~qsync_lab.simulate.PlanEvaluator` (the one evaluation path, which the allocator
uses too); this module renders its state as events. To simulate many plans of one model,
pass :func:`prepare_graph`'s result instead of the graph.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.cluster import load_cluster
    >>> from qsync_lab.costs import CostModel
    >>> from qsync_lab.graph import trace_graph
    >>> graph = trace_graph(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)),
    ...                     torch.randn(4, 64))
    >>> sim = simulate(graph, {"T4": {"0": "fp16"}}, load_cluster("local-hybrid"), CostModel())
    >>> sim.world_size, sim.iteration_us > 0, sorted(sim.events["stream"].unique())
    (2, True, ['comm', 'compute'])
"""

from collections.abc import Mapping

import numpy as np
import pandas as pd

from qsync_lab.cluster import Cluster
from qsync_lab.constraints import Constraints
from qsync_lab.costs import Cost, CostModel
from qsync_lab.errors import QSyncError
from qsync_lab.graph import OpGraph
from qsync_lab.optimizers import DEFAULT_OPTIMIZER
from qsync_lab.plan import Plan
from qsync_lab.policy import KindPlan
from qsync_lab.simulate.compression import BucketComm
from qsync_lab.simulate.evaluator import PlanEvaluator
from qsync_lab.simulate.events import StreamEvents
from qsync_lab.simulate.memory import MEMORY_COMPONENTS
from qsync_lab.simulate.prepare import PreparedGraph, prepare_graph
from qsync_lab.simulate.result import SimResult
from qsync_lab.simulate.schedule import ComputeTimeline
from qsync_lab.simulate.sync import AllreduceReplay

__all__ = ["plan_parts", "render", "simulate"]

_US_PER_S = 1e6


def simulate(graph: "OpGraph | PreparedGraph", plan: "Plan | Mapping[str, KindPlan]",
             cluster: Cluster | None = None, costs: CostModel | None = None, *,
             optimizer: str | None = None, compression=None,
             bucket_cap_mb: float | None = None) -> SimResult:
    """Simulate one training iteration (see the module docstring).

    Args:
        graph: the model's :class:`~qsync_lab.graph.OpGraph` (traced at any batch size;
            per-rank batch sizes come from ``cluster``), or :func:`prepare_graph`'s result
            for it when simulating many plans of one model.
        plan: a :class:`~qsync_lab.plan.Plan` (its batch sizes and optimizer apply), or
            device kind -> {op FQN -> precision spec}; ops it leaves out follow the policy
            (:mod:`qsync_lab.policy`: fp32 for plannable kinds).
        cluster: the ranks, their devices and batch sizes, and the links (default: the
            plan's own cluster).
        costs: the cost model (default: :class:`CostModel`'s roofline).
        optimizer: ``sgd``, ``sgd_momentum``, ``adam`` or ``adamw`` (default: the plan's,
            else :data:`~qsync_lab.optimizers.DEFAULT_OPTIMIZER`).
        compression: gradient compression (a spec such as ``"global_qsgd:8"``, a mapping
            parameter pattern -> spec; default: the plan's, else none).
        bucket_cap_mb: DDP's ``bucket_cap_mb`` (None: DDP's default); for a prepared graph
            leave it None (the buckets are already built).

    Raises:
        QSyncError: an invalid plan or optimizer, in one line.
    """
    if isinstance(plan, Plan) and compression is None:
        compression = plan.compression_settings
    constraints = plan.constraints if isinstance(plan, Plan) else None
    plan, cluster, optimizer = plan_parts(plan, cluster, optimizer)
    costs = costs if costs is not None else CostModel()
    prepared = _prepared(graph, bucket_cap_mb)
    return render(PlanEvaluator(prepared, cluster, costs, plan, optimizer=optimizer,
                                compression=compression), constraints)


def render(evaluator: PlanEvaluator, constraints: Constraints | None = None) -> SimResult:
    """The :class:`SimResult` of an evaluator's current state, its memory budgets those of
    ``constraints`` (default: each device's memory)."""
    prepared, cluster, replay = evaluator.prepared, evaluator.cluster, evaluator.replay
    states = evaluator.states
    comm = _comm_stream(replay, evaluator.comm, prepared.bucket_bytes)
    compute = tuple(
        _finish_iteration(state.timeline, replay, i, evaluator.optimizer, *evaluator.tails[i],
                          prepared.grad_param_bytes)
        for i, state in enumerate(states))
    iteration_us = evaluator.iteration_us
    class_index = {c: i for i, c in enumerate(evaluator.classes)}
    class_of_rank = np.array([class_index[(r.device, r.batch_size)] for r in cluster.ranks])
    busy_us = np.array([stream.dur_us.sum() for stream in compute])[class_of_rank]
    memory = pd.DataFrame([state.memory for state in states], columns=list(MEMORY_COMPONENTS))
    ranks = pd.RangeIndex(cluster.world_size, name="rank")
    per_rank_memory = memory.iloc[class_of_rank].set_axis(ranks)
    wire = sum(bucket.sent_bytes for bucket in evaluator.comm)
    budgets = constraints or Constraints()
    return SimResult(
        iteration_us=iteration_us,
        idle_us=pd.Series(iteration_us - busy_us, index=ranks, name="idle_us"),
        tensor_peak_bytes=per_rank_memory.sum(axis=1).rename("tensor_peak_bytes"),
        memory_breakdown=per_rank_memory,
        memory_budget_bytes=pd.Series([budgets.memory_budget_bytes(cluster, r.device)
                                       for r in cluster.ranks], index=ranks,
                                      name="memory_budget_bytes"),
        wire_bytes=pd.Series(float(wire), index=ranks, name="wire_bytes"),
        throughput_samples_per_s=cluster.global_batch_size / (iteration_us / _US_PER_S),
        rank_devices=tuple(r.device for r in cluster.ranks),
        rank_batch_sizes=tuple(r.batch_size for r in cluster.ranks),
        class_of_rank=class_of_rank,
        compute=compute,
        comm=comm,
    )


def plan_parts(plan: "Plan | Mapping[str, KindPlan]", cluster: Cluster | None,
               optimizer: str | None) -> tuple[Mapping[str, KindPlan], Cluster, str]:
    """The per-kind precisions, cluster (with the plan's batch sizes) and optimizer that
    :func:`simulate` uses for ``plan`` and its optional ``cluster``/``optimizer``."""
    if isinstance(plan, Plan):
        cluster = plan.apply_to(cluster) if cluster is not None else plan.cluster
        return plan.precisions, cluster, optimizer or plan.optimizer
    if cluster is None:
        raise QSyncError("simulating a plan given as a mapping needs its cluster; pass "
                         "cluster=, or pass a Plan")
    return plan, cluster, optimizer or DEFAULT_OPTIMIZER


def _prepared(graph: "OpGraph | PreparedGraph", bucket_cap_mb: float | None) -> PreparedGraph:
    if not isinstance(graph, PreparedGraph):
        return prepare_graph(graph, bucket_cap_mb=bucket_cap_mb)
    if bucket_cap_mb is not None and bucket_cap_mb != graph.bucket_cap_mb:
        raise QSyncError(f"the prepared graph's buckets use bucket_cap_mb="
                         f"{graph.bucket_cap_mb}, not {bucket_cap_mb}; prepare it again "
                         "with that cap or leave bucket_cap_mb out")
    return graph


def _comm_stream(replay: AllreduceReplay, comm: list[BucketComm],
                 bucket_bytes) -> StreamEvents:
    """One event per bucket, as replayed: ``allreduce`` (fp32) or ``compressed`` (its
    specs in the plan precision field), with the bucket's bytes."""
    n = len(comm)
    if not n:
        return StreamEvents.empty()
    return StreamEvents.from_lists(
        [f"allreduce:bucket{k}" for k in range(n)], [""] * n,
        ["allreduce" if c.label == "fp32" else "compressed" for c in comm], ["backward"] * n,
        ["fp32"] * n, [c.label for c in comm], [c.cost.source for c in comm],
        replay.begin_us, replay.dur_us, bucket_bytes)


def _finish_iteration(line: ComputeTimeline, replay: AllreduceReplay, index: int,
                      optimizer: str, unpack: Cost | None, step: Cost,
                      param_bytes: float) -> StreamEvents:
    """Class ``index``'s compute stream with the replay's delays, then the bucket unpack and
    the optimizer step once its backward and the last allreduce are done."""
    e = line.events
    start_us, dur_us = replay.delayed(index, e.start_us, e.dur_us)
    begin_us = max(replay.backward_end_us[index], replay.end_us)
    tail = [(f"optimizer:{optimizer}", "optimizer", "optimizer", step, param_bytes)]
    if unpack is not None:
        tail.insert(0, ("ddp:unpack", "ddp", "backward", unpack, param_bytes))
    # the step starts when the unpack ends, added as tail_end_us adds them
    tail_start = [begin_us] if unpack is None else [begin_us, begin_us + unpack.us]
    return StreamEvents(
        e.op + tuple(t[0] for t in tail), e.fqn + ("",) * len(tail),
        e.category + tuple(t[1] for t in tail), e.phase + tuple(t[2] for t in tail),
        e.precision + ("fp32",) * len(tail), e.plan_precision + ("fp32",) * len(tail),
        e.source + tuple(t[3].source for t in tail),
        np.append(start_us, tail_start), np.append(dur_us, [t[3].us for t in tail]),
        np.append(e.bytes, [t[4] for t in tail]))
