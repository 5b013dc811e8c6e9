"""``simulate``: replay one DDP training iteration of a hybrid cluster under a precision plan.

Per rank there is a compute stream and a communication stream:

1. The compute stream runs forward, casts and backward back to back
   (:mod:`qsync_lab.simulate.schedule`); on several ranks it first waits for DDP's
   broadcast of the model's buffers from rank 0 (``broadcast_buffers=True``, DDP's
   default; :func:`buffer_broadcast`).
2. The communication stream runs one ring allreduce per DDP gradient bucket, in DDP's
   steady-state bucket order (:func:`qsync_lab.graph.ddp_buckets`). Bucket ``k`` starts
   once *every* rank has produced all of its gradients and allreduce ``k-1`` has ended, so
   the slowest rank gates every allreduce; its duration is the ring cost over the slowest
   link of the ring (ranks in rank order). The last buckets overlap with backward.
3. The optimizer step starts on each rank when its backward and the last allreduce are
   done. The iteration ends when the last rank's step ends.

Ranks with the same device kind and batch size share one compute timeline (the plan is
per device kind), so the cost grows with the number of such classes plus a linear pass
over the ranks. To simulate many plans of one model, pass :func:`prepare_graph`'s result
instead of the graph.

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
from qsync_lab.costs import Cost, CostModel, ring_wire_bytes
from qsync_lab.devices import LinkSpec
from qsync_lab.errors import QSyncError
from qsync_lab.graph import OpGraph
from qsync_lab.simulate.events import StreamEvents
from qsync_lab.simulate.memory import MEMORY_COMPONENTS, memory_breakdown
from qsync_lab.simulate.policy import KindPlan, resolve_precisions, validate_plan
from qsync_lab.simulate.prepare import PreparedGraph, prepare_graph
from qsync_lab.simulate.result import SimResult
from qsync_lab.simulate.schedule import ComputeTimeline, compute_timeline

__all__ = ["simulate"]

_US_PER_S = 1e6


def simulate(graph: "OpGraph | PreparedGraph", plan: Mapping[str, KindPlan], cluster: Cluster,
             costs: CostModel, *, optimizer: str = "sgd",
             bucket_cap_mb: float | None = None) -> SimResult:
    """Simulate one training iteration (see the module docstring).

    Args:
        graph: the model's :class:`~qsync_lab.graph.OpGraph` (traced at any batch size;
            per-rank batch sizes come from ``cluster``), or :func:`prepare_graph`'s result
            for it when simulating many plans of one model.
        plan: device kind -> {op FQN -> precision}; ops it leaves out follow
            :mod:`qsync_lab.simulate.policy` (fp32 for plannable kinds).
        cluster: the ranks, their devices and batch sizes, and the links.
        costs: the cost model.
        optimizer: ``sgd``, ``sgd_momentum``, ``adam`` or ``adamw``.
        bucket_cap_mb: DDP's ``bucket_cap_mb`` (None: DDP's default); for a prepared graph
            leave it None (the buckets are already built).

    Raises:
        QSyncError: an invalid plan or optimizer, in one line.
    """
    prepared = _prepared(graph, bucket_cap_mb)
    work = prepared.work
    kinds = validate_plan(plan, work, cluster.device_kinds, cluster.catalog)
    devices = {name: cluster.catalog.device(name) for name in cluster.device_kinds}
    classes = sorted({(r.device, r.batch_size) for r in cluster.ranks},
                     key=lambda c: (cluster.device_kinds.index(c[0]), c[1]))
    assignments = {name: resolve_precisions(work, planned, devices[name])
                   for name, planned in kinds.items()}
    broadcast = buffer_broadcast(prepared, cluster, costs)
    timelines = [compute_timeline(work, assignments[name], costs, devices[name],
                                  batch_size=batch, broadcast=broadcast)
                 for name, batch in classes]
    comm = _allreduce_stream(prepared, timelines, costs, cluster)
    comm_end_us = float(comm.end_us[-1]) if len(comm) else 0.0
    compute = tuple(
        _with_optimizer(line, max(line.backward_end_us, comm_end_us), optimizer,
                        costs.optimizer_time_us(prepared.grad_param_bytes, optimizer,
                                                devices[name]), prepared.grad_param_bytes)
        for line, (name, _) in zip(timelines, classes))
    iteration_us = max(float(stream.end_us[-1]) for stream in compute)
    class_index = {c: i for i, c in enumerate(classes)}
    class_of_rank = np.array([class_index[(r.device, r.batch_size)] for r in cluster.ranks])
    busy_us = np.array([stream.dur_us.sum() for stream in compute])[class_of_rank]
    memory = pd.DataFrame(
        [memory_breakdown(work, prepared.graph.params, assignments[name], batch_size=batch,
                          optimizer=optimizer, bucket_bytes=float(prepared.bucket_bytes.sum()))
         for name, batch in classes], columns=list(MEMORY_COMPONENTS))
    ranks = pd.RangeIndex(cluster.world_size, name="rank")
    per_rank_memory = memory.iloc[class_of_rank].set_axis(ranks)
    wire = sum(ring_wire_bytes(b, cluster.world_size) for b in prepared.bucket_bytes)
    return SimResult(
        iteration_us=iteration_us,
        idle_us=pd.Series(iteration_us - busy_us, index=ranks, name="idle_us"),
        peak_memory_bytes=per_rank_memory.sum(axis=1).rename("peak_memory_bytes"),
        memory_breakdown=per_rank_memory,
        wire_bytes=pd.Series(float(wire), index=ranks, name="wire_bytes"),
        throughput_samples_per_s=cluster.global_batch_size / (iteration_us / _US_PER_S),
        rank_devices=tuple(r.device for r in cluster.ranks),
        rank_batch_sizes=tuple(r.batch_size for r in cluster.ranks),
        class_of_rank=class_of_rank,
        compute=compute,
        comm=comm,
    )


def _prepared(graph: "OpGraph | PreparedGraph", bucket_cap_mb: float | None) -> PreparedGraph:
    if not isinstance(graph, PreparedGraph):
        return prepare_graph(graph, bucket_cap_mb=bucket_cap_mb)
    if bucket_cap_mb is not None and bucket_cap_mb != graph.bucket_cap_mb:
        raise QSyncError(f"the prepared graph's buckets use bucket_cap_mb="
                         f"{graph.bucket_cap_mb}, not {bucket_cap_mb}; prepare it again "
                         "with that cap or leave bucket_cap_mb out")
    return graph


def buffer_broadcast(prepared: PreparedGraph, cluster: Cluster, costs: CostModel) -> Cost | None:
    """DDP's broadcast of the model's buffers from rank 0 before every forward (its default
    ``broadcast_buffers=True``); None on one rank or for a model without buffers."""
    if cluster.world_size == 1 or not prepared.graph.buffer_bytes:
        return None
    return costs.broadcast_time_us(prepared.graph.buffer_bytes, cluster.world_size,
                                   _ring_links(cluster))


def _allreduce_stream(prepared: PreparedGraph, timelines: list[ComputeTimeline],
                      costs: CostModel, cluster: Cluster) -> StreamEvents:
    """One allreduce per bucket: start = max(every class's ready time, previous end)."""
    if cluster.world_size == 1 or not len(prepared.bucket_bytes):
        return StreamEvents.empty()
    links = _ring_links(cluster)
    start, dur, source = [], [], []
    end_us = 0.0
    for size, ops in zip(prepared.bucket_bytes, prepared.bucket_ops):
        ready_us = max(_bucket_ready_us(line, ops) for line in timelines)
        cost = costs.allreduce_time_us(size, cluster.world_size, links)
        begin = max(ready_us, end_us)
        end_us = begin + cost.us
        start.append(begin)
        dur.append(cost.us)
        source.append(cost.source)
    n = len(start)
    return StreamEvents.from_lists([f"allreduce:bucket{k}" for k in range(n)], [""] * n,
                                   ["allreduce"] * n, ["backward"] * n, ["fp32"] * n,
                                   ["fp32"] * n, source, start, dur, prepared.bucket_bytes)


def _bucket_ready_us(line: ComputeTimeline, ops: tuple[int | None, ...]) -> float:
    """When a class has produced every gradient of a bucket (unused params: backward end)."""
    return max(line.backward_end_us if i is None else float(line.grad_ready_us[i])
               for i in ops)


def _ring_links(cluster: Cluster) -> list[LinkSpec]:
    """The distinct links between ring neighbours (ranks in rank order, wrapping)."""
    nodes = np.array([r.node for r in cluster.ranks])
    following = np.roll(nodes, -1)
    links = [cluster.intra_node_links[node] for node in np.unique(nodes[nodes == following])]
    if (nodes != following).any():
        if cluster.inter_node_link is None:
            raise QSyncError(f"cluster {cluster.name!r} has several nodes but no "
                             "inter_node_link; set one")
        links.append(cluster.inter_node_link)
    return links


def _with_optimizer(line: ComputeTimeline, start_us: float, optimizer: str, cost: Cost,
                    param_bytes: float) -> StreamEvents:
    """The class's compute stream with the optimizer step appended at ``start_us``."""
    e = line.events
    return StreamEvents(
        e.op + (f"optimizer:{optimizer}",), e.fqn + ("",), e.category + ("optimizer",),
        e.phase + ("optimizer",), e.precision + ("fp32",), e.plan_precision + ("fp32",),
        e.source + (cost.source,), np.append(e.start_us, start_us), np.append(e.dur_us, cost.us),
        np.append(e.bytes, param_bytes))
