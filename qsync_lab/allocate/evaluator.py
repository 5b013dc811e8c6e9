"""Incremental iteration-time and memory evaluation for the allocator's trial loop.

:func:`~qsync_lab.simulate.simulate` rebuilds every rank class's compute timeline, the
allreduce stream and the memory of every class. A one-op change on one device kind only
changes the classes (device kind, batch size) of that kind, so :class:`PlanEvaluator`
keeps every class's :class:`~qsync_lab.simulate.ComputeTimeline` and memory and, for a
trial, rebuilds only the changed kind's classes, then replays the allreduce stream
(:func:`~qsync_lab.simulate.replay_allreduces`), the bucket unpacks and the optimizer
steps. Allreduce, unpack and optimizer durations do not depend on the plan (gradients
are fp32), so they are computed once. The result equals ``simulate(...).iteration_us`` and
``peak_memory_bytes`` exactly (tested).

A trial is a :class:`Proposal`: a new value, nothing changed. :meth:`PlanEvaluator.accept`
installs it; a rejected proposal is dropped and leaves no trace.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.cluster import load_cluster
    >>> from qsync_lab.costs import CostModel
    >>> from qsync_lab.graph import trace_graph
    >>> from qsync_lab.simulate import prepare_graph, simulate
    >>> graph = trace_graph(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)),
    ...                     torch.randn(4, 64))
    >>> cluster, costs = load_cluster("v100-t4-small"), CostModel()
    >>> evaluator = PlanEvaluator(prepare_graph(graph), cluster, costs)
    >>> trial = evaluator.propose("T4", {0: "fp16"})
    >>> trial.iteration_us == simulate(graph, {"T4": {"0": "fp16"}}, cluster, costs).iteration_us
    True
"""

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


from qsync_lab.cluster import Cluster
from qsync_lab.costs import CostModel
from qsync_lab.precision import Precision
from qsync_lab.policy import resolve_precisions, validate_plan
from qsync_lab.simulate import (ComputeTimeline, PreparedGraph, compute_timeline, ddp_work,
                                memory_breakdown, replay_allreduces, shares_cores, simulate,
                                sync_costs)

__all__ = ["PlanEvaluator", "Proposal"]

KindState = Mapping[int, Precision]


@dataclass(frozen=True, eq=False)
class Proposal:
    """The cluster's iteration time and one kind's memory if that kind ran ``plan``.

    Attributes:
        kind: the device kind the proposal changes.
        plan: that kind's whole plan (op index -> precision) after the change.
        iteration_us: predicted iteration time of the cluster.
        peak_memory_bytes: the kind's largest per-rank peak memory.
        timelines: the kind's class timelines (for :meth:`PlanEvaluator.accept`).
        memory_bytes: the kind's per-class peak memory.
    """

    kind: str
    plan: KindState
    iteration_us: float
    peak_memory_bytes: float
    timelines: tuple[ComputeTimeline, ...]
    memory_bytes: tuple[float, ...]


class PlanEvaluator:
    """Iteration time and memory of a cluster under a plan that changes one kind at a time.

    Args:
        prepared: the model's :func:`~qsync_lab.simulate.prepare_graph` result.
        cluster: the ranks (with their batch sizes) and links.
        costs: the cost model.
        plan: the starting plan, device kind -> {op FQN or index -> precision}.
        optimizer: as for :func:`~qsync_lab.simulate.simulate`.
    """

    def __init__(self, prepared: PreparedGraph, cluster: Cluster, costs: CostModel,
                 plan: Mapping[str, Mapping["int | str", "Precision | str"]] | None = None, *,
                 optimizer: str = "sgd") -> None:
        self.prepared, self.cluster, self.costs, self.optimizer = (prepared, cluster, costs,
                                                                  optimizer)
        work = prepared.work
        named = {kind: {(work.names[k] if isinstance(k, int) else k): p for k, p in ops.items()}
                 for kind, ops in (plan or {}).items()}
        self._state = {kind: MappingProxyType(ops) for kind, ops in
                       validate_plan(named, work, cluster.device_kinds, cluster.catalog).items()}
        self.devices = {name: cluster.catalog.device(name) for name in cluster.device_kinds}
        self.classes = tuple(sorted({(r.device, r.batch_size) for r in cluster.ranks},
                                    key=lambda c: (cluster.device_kinds.index(c[0]), c[1])))
        self._ddp = ddp_work(prepared, cluster, costs)
        self._allreduce_us = simulate(prepared, named, cluster, costs,
                                      optimizer=optimizer).comm.dur_us.tolist()
        self._after_backward_us = []
        for name, _ in self.classes:
            unpack, step = sync_costs(prepared, cluster, costs, self.devices[name], optimizer)
            self._after_backward_us.append(step.us + (unpack.us if unpack else 0.0))
        self._shared = [shares_cores(self.devices[name]) for name, _ in self.classes]
        self._bucket_bytes = float(prepared.bucket_bytes.sum())
        self._timelines: list[ComputeTimeline] = []
        self._memory: list[float] = []
        for name, batch in self.classes:
            line, memory = self._class(name, batch, self._state[name])
            self._timelines.append(line)
            self._memory.append(memory)
        self.iteration_us = self._iteration_us(self._timelines)

    @property
    def timelines(self) -> tuple[ComputeTimeline, ...]:
        """The current compute timeline of every class, in :attr:`classes` order."""
        return tuple(self._timelines)

    def plan(self, kind: str) -> KindState:
        """The current plan of ``kind`` (op index -> precision; missing ops follow the policy)."""
        return self._state[kind]

    def peak_memory_bytes(self, kind: str) -> float:
        """The largest per-rank peak memory among ``kind``'s ranks."""
        return max(m for m, (name, _) in zip(self._memory, self.classes) if name == kind)

    def propose(self, kind: str, changes: Mapping[int, "Precision | str | None"]) -> Proposal:
        """Evaluate ``kind``'s plan with ``changes`` applied (None removes an op's entry).

        Nothing changes until :meth:`accept`.
        """
        plan = dict(self._state[kind])
        for op, precision in changes.items():
            if precision is None:
                plan.pop(op, None)
            else:
                plan[op] = Precision.parse(precision)
        return self.propose_plan(kind, plan)

    def propose_plan(self, kind: str, plan: Mapping[int, Precision]) -> Proposal:
        """Evaluate ``kind`` running ``plan`` (op index -> precision) instead of its current one."""
        positions = [i for i, (name, _) in enumerate(self.classes) if name == kind]
        timelines = list(self._timelines)
        lines, memory = [], []
        for i in positions:
            line, mem = self._class(kind, self.classes[i][1], plan)
            timelines[i] = line
            lines.append(line)
            memory.append(mem)
        return Proposal(kind, MappingProxyType(dict(plan)), self._iteration_us(timelines),
                        max(memory), tuple(lines), tuple(memory))

    def memory_bytes(self, kind: str, plan: Mapping[int, Precision]) -> float:
        """The largest per-rank peak memory of ``kind`` if it ran ``plan`` (no timeline)."""
        work, device = self.prepared.work, self.devices[kind]
        assignment = resolve_precisions(work, plan, device)
        return max(float(sum(memory_breakdown(
            work, self.prepared.graph.params, assignment, batch_size=batch,
            optimizer=self.optimizer, bucket_bytes=self._bucket_bytes).values()))
            for name, batch in self.classes if name == kind)

    def accept(self, proposal: Proposal) -> None:
        """Make ``proposal`` the current state of its kind."""
        positions = [i for i, (name, _) in enumerate(self.classes) if name == proposal.kind]
        for i, line, memory in zip(positions, proposal.timelines, proposal.memory_bytes):
            self._timelines[i] = line
            self._memory[i] = memory
        self._state[proposal.kind] = proposal.plan
        self.iteration_us = self._iteration_us(self._timelines)

    def pace_us(self, kind: str) -> float:
        """The iteration time if every rank's forward and backward ran like ``kind`` in full
        precision (fp32, at the rank's batch size). Allreduces, unpacks and each rank's own
        optimizer step stay as they are: no precision plan changes them."""
        device = self.devices[kind]
        work = self.prepared.work
        assignment = resolve_precisions(work, {}, device)
        lines = {batch: compute_timeline(work, assignment, self.costs, device, batch_size=batch,
                                         ddp=self._ddp)
                 for batch in {b for _, b in self.classes}}
        return self._iteration_us([lines[batch] for _, batch in self.classes])

    def _class(self, kind: str, batch: int, plan: KindState) -> tuple[ComputeTimeline, float]:
        work, device = self.prepared.work, self.devices[kind]
        assignment = resolve_precisions(work, plan, device)
        line = compute_timeline(work, assignment, self.costs, device, batch_size=batch,
                                ddp=self._ddp)
        memory = memory_breakdown(work, self.prepared.graph.params, assignment, batch_size=batch,
                                  optimizer=self.optimizer, bucket_bytes=self._bucket_bytes)
        return line, float(sum(memory.values()))

    def _iteration_us(self, timelines: list[ComputeTimeline]) -> float:
        """Replay the allreduce stream, the unpacks and the optimizer steps (as the
        simulator does)."""
        replay = replay_allreduces([line.bucket_ready_us for line in timelines],
                                   [line.backward_end_us for line in timelines],
                                   self._allreduce_us, self._shared)
        return max(max(end_us, replay.end_us) + after
                   for end_us, after in zip(replay.backward_end_us, self._after_backward_us))
