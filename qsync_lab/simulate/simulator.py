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
from qsync_lab.policy import KindPlan, resolve_precisions, validate_plan
from qsync_lab.simulate.prepare import PreparedGraph, prepare_graph
from qsync_lab.simulate.result import SimResult
from qsync_lab.simulate.schedule import ComputeTimeline, compute_timeline
from qsync_lab.simulate.sync import (AllreduceReplay, DdpWork, copy_time_us, replay_allreduces,
                                     shares_cores)

__all__ = ["ddp_work", "simulate", "sync_costs"]

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
    ddp = ddp_work(prepared, cluster, costs)
    timelines = [compute_timeline(work, assignments[name], costs, devices[name],
                                  batch_size=batch, ddp=ddp)
                 for name, batch in classes]
    allreduce = _allreduce_costs(prepared, cluster, costs)
    replay = replay_allreduces([line.bucket_ready_us for line in timelines],
                               [line.backward_end_us for line in timelines],
                               [c.us for c in allreduce],
                               [shares_cores(devices[name]) for name, _ in classes])
    comm = _allreduce_stream(prepared, replay, allreduce)
    compute = tuple(
        _finish_iteration(line, replay, i, optimizer,
                          *sync_costs(prepared, cluster, costs, devices[name], optimizer),
                          prepared.grad_param_bytes)
        for i, (line, (name, _)) in enumerate(zip(timelines, classes)))
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


def ddp_work(prepared: PreparedGraph, cluster: Cluster, costs: CostModel) -> DdpWork | None:
    """What DDP adds to every rank's compute stream; None on one rank."""
    if cluster.world_size == 1:
        return None
    broadcast = (costs.broadcast_time_us(prepared.graph.buffer_bytes, cluster.world_size,
                                         _ring_links(cluster))
                 if prepared.graph.buffer_bytes else None)
    return DdpWork(broadcast, prepared.bucket_ops, prepared.bucket_bytes)


def sync_costs(prepared: PreparedGraph, cluster: Cluster, costs: CostModel, device,
               optimizer: str) -> tuple[Cost | None, Cost]:
    """A rank's costs after the backward: the bucket unpack (None on one rank) and the
    optimizer step. They do not depend on the precision plan (gradients are fp32)."""
    unpack = (copy_time_us(float(prepared.bucket_bytes.sum()), costs, device)
              if cluster.world_size > 1 and len(prepared.bucket_bytes) else None)
    return unpack, costs.optimizer_time_us(prepared.grad_param_bytes, optimizer, device)


def _allreduce_costs(prepared: PreparedGraph, cluster: Cluster, costs: CostModel) -> list[Cost]:
    if cluster.world_size == 1:
        return []
    links = _ring_links(cluster)
    return [costs.allreduce_time_us(size, cluster.world_size, links)
            for size in prepared.bucket_bytes]


def _allreduce_stream(prepared: PreparedGraph, replay: AllreduceReplay,
                      allreduce: list[Cost]) -> StreamEvents:
    """One allreduce event per bucket, as replayed."""
    n = len(allreduce)
    if not n:
        return StreamEvents.empty()
    return StreamEvents.from_lists([f"allreduce:bucket{k}" for k in range(n)], [""] * n,
                                   ["allreduce"] * n, ["backward"] * n, ["fp32"] * n,
                                   ["fp32"] * n, [c.source for c in allreduce],
                                   replay.begin_us, replay.dur_us, prepared.bucket_bytes)


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
    tail_start, tail_dur = [], []
    for *_, cost, _ in tail:
        tail_start.append(begin_us)
        tail_dur.append(cost.us)
        begin_us += cost.us
    return StreamEvents(
        e.op + tuple(t[0] for t in tail), e.fqn + ("",) * len(tail),
        e.category + tuple(t[1] for t in tail), e.phase + tuple(t[2] for t in tail),
        e.precision + ("fp32",) * len(tail), e.plan_precision + ("fp32",) * len(tail),
        e.source + tuple(t[3].source for t in tail),
        np.append(start_us, tail_start), np.append(dur_us, tail_dur),
        np.append(e.bytes, [t[4] for t in tail]))
