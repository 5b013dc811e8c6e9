"""The simulator's state: one iteration of a cluster kept per rank class, re-costed by kind.

Ranks with the same device kind and batch size (a *class*) share one compute timeline, so
:class:`PlanEvaluator` keeps every class's :class:`~qsync_lab.simulate.ComputeTimeline` and
memory breakdown. A plan change on one device kind rebuilds only that kind's classes, then
replays the allreduce stream (:func:`~qsync_lab.simulate.replay_allreduces`), the bucket
unpacks and the optimizer steps; allreduce, unpack and optimizer durations do not depend
on the plan (gradients are fp32), so they are computed once. This is the only evaluation
path: :func:`~qsync_lab.simulate.simulate` renders an evaluator's state as a
:class:`~qsync_lab.simulate.SimResult`, and the allocator's trial loop proposes and
accepts plans on one.

A trial is a :class:`Proposal`: a new value, nothing changed. :meth:`PlanEvaluator.accept`
installs it; a rejected proposal is dropped and leaves no trace. What a plan of one kind
costs does not depend on the rest of the cluster's plan, so every class state and memory
evaluated is kept in a least-recently-used memo, shared with the evaluator's
:meth:`~PlanEvaluator.fork` copies: a search that proposes a plan again (or re-plans under
other constraints from a fork) gets it without re-simulating.

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
    >>> twin = evaluator.fork()
    >>> twin.accept(trial)
    >>> twin.iteration_us == trial.iteration_us != evaluator.iteration_us
    True
"""

import copy
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


from qsync_lab.cluster import Cluster
from qsync_lab.costs import Cost, CostModel
from qsync_lab.optimizers import DEFAULT_OPTIMIZER
from qsync_lab.policy import OpPrecision, PrecisionAssignment, resolve_precisions, validate_plan
from qsync_lab.policy.resolve import re_resolve
from qsync_lab.simulate.compression import bucket_comm
from qsync_lab.simulate.memory import MemoryModel
from qsync_lab.simulate.prepare import PreparedGraph
from qsync_lab.simulate.schedule import ComputeTimeline, TimelineBuilder
from qsync_lab.simulate.sync import (AllreduceReplay, DdpWork, copy_time_us, replay_allreduces,
                                     shares_cores)

__all__ = ["PlanEvaluator", "Proposal", "tail_end_us"]

KindState = Mapping[int, OpPrecision]

#: class states and memories an evaluator and its forks keep (least recently used dropped)
MEMO_SIZE = 1024


@dataclass(frozen=True, eq=False)
class ClassState:
    """One class's precisions, compute timeline and memory breakdown."""

    assignment: PrecisionAssignment
    timeline: ComputeTimeline
    memory: Mapping[str, float]

    @property
    def memory_bytes(self) -> float:
        return float(sum(self.memory.values()))


@dataclass(frozen=True, eq=False)
class Proposal:
    """The cluster's iteration time and one kind's memory if that kind ran ``plan``.

    Attributes:
        kind: the device kind the proposal changes.
        plan: that kind's whole plan (op index -> config) after the change.
        iteration_us: predicted iteration time of the cluster.
        tensor_peak_bytes: the kind's largest per-rank peak tensor memory.
        states: the kind's class states (for :meth:`PlanEvaluator.accept`).
        key: the plan as the evaluator's memo keys it.
    """

    kind: str
    plan: KindState
    iteration_us: float
    tensor_peak_bytes: float
    states: tuple[ClassState, ...]
    key: frozenset = field(repr=False)

    @property
    def timelines(self) -> tuple[ComputeTimeline, ...]:
        """The kind's class timelines under the proposal."""
        return tuple(s.timeline for s in self.states)


class _Memo:
    """A least-recently-used cache of pure evaluations."""

    def __init__(self, size: int) -> None:
        self.size, self._entries = size, OrderedDict()
        self._config_ids: dict[OpPrecision, int] = {}

    def plan_key(self, plan: Mapping[int, OpPrecision]) -> frozenset:
        """``plan`` as a key: (op, config number) pairs, plain numbers that the garbage
        collector need not scan however many keys the memo keeps."""
        ids = self._config_ids
        return frozenset([(op, ids.setdefault(cfg, len(ids))) for op, cfg in plan.items()])

    def changed_key(self, key: frozenset, plan: Mapping[int, OpPrecision],
                    changes: Mapping[int, OpPrecision | None]) -> frozenset:
        """The key of ``plan`` (keyed ``key``) with ``changes`` applied (None: the op
        leaves the plan)."""
        ids = self._config_ids
        gone = [(op, ids[plan[op]]) for op in changes if op in plan]
        new = [(op, ids.setdefault(cfg, len(ids))) for op, cfg in changes.items()
               if cfg is not None]
        return key.difference(gone).union(new)

    def get(self, key: Hashable, compute: Callable[[], object]):
        """The value of ``key``, computed by ``compute()`` on a miss."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        value = self._entries[key] = compute()
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value


def tail_end_us(begin_us: float, unpack: Cost | None, step: Cost) -> float:
    """When a rank's bucket unpack and optimizer step, run back to back from ``begin_us``,
    end (the simulator's events add them in this order too)."""
    end = begin_us + (unpack.us if unpack is not None else 0.0)
    return end + step.us


class PlanEvaluator:
    """Iteration time and memory of a cluster under a plan that changes one kind at a time.

    Args:
        prepared: the model's :func:`~qsync_lab.simulate.prepare_graph` result.
        cluster: the ranks (with their batch sizes) and links.
        costs: the cost model.
        plan: the starting plan, device kind -> {op FQN or index -> precision spec}.
        optimizer: ``sgd``, ``sgd_momentum``, ``adam`` or ``adamw``.
        compression: gradient compression settings (a spec, a mapping parameter pattern ->
            spec, or None; :mod:`qsync_lab.simulate.compression` costs them).

    Attribute ``memory_model``: the :class:`~qsync_lab.simulate.memory.MemoryModel` of
    every memory breakdown (the allocator's per-op estimates read it too).
    """

    def __init__(self, prepared: PreparedGraph, cluster: Cluster, costs: CostModel,
                 plan: Mapping[str, Mapping["int | str", object]] | None = None, *,
                 optimizer: str = DEFAULT_OPTIMIZER, compression=None) -> None:
        self.prepared, self.cluster, self.costs, self.optimizer = (prepared, cluster, costs,
                                                                  optimizer)
        self._state = {kind: MappingProxyType(ops) for kind, ops in validate_plan(
            plan or {}, prepared.work, cluster.device_kinds, cluster.catalog).items()}
        self.devices = {name: cluster.catalog.device(name) for name in cluster.device_kinds}
        self.classes = tuple(sorted({(r.device, r.batch_size) for r in cluster.ranks},
                                    key=lambda c: (cluster.device_kinds.index(c[0]), c[1])))
        self.ddp = _ddp_work(prepared, cluster, costs)
        self.comm = bucket_comm(prepared, cluster, costs, compression, cluster.ring_links()
                                if cluster.world_size > 1 else None)
        self.tails = tuple(_tail_costs(prepared, cluster, costs, self.devices[name], optimizer)
                           for name, _ in self.classes)
        self._shared = [shares_cores(self.devices[name]) for name, _ in self.classes]
        self._bucket_bytes = float(prepared.bucket_bytes.sum())
        self._memo = _Memo(MEMO_SIZE)
        self.memory_model = MemoryModel(prepared.work, prepared.graph.params,
                                         optimizer=optimizer, bucket_bytes=self._bucket_bytes)
        self._builders: dict[tuple[str, int], TimelineBuilder] = {}
        self._keys = {kind: self._memo.plan_key(plan) for kind, plan in self._state.items()}
        self._states = [self._class(name, batch, self._state[name], self._keys[name])
                        for name, batch in self.classes]
        self.replay, self.iteration_us = self._replay([s.timeline for s in self._states])

    def fork(self) -> "PlanEvaluator":
        """A copy in the same state that shares the costs and the memo: what it proposes
        and accepts leaves this evaluator as it is."""
        twin = copy.copy(self)
        twin._state, twin._states, twin._keys = (dict(self._state), list(self._states),
                                                 dict(self._keys))
        return twin

    @property
    def states(self) -> tuple[ClassState, ...]:
        """The current state of every class, in :attr:`classes` order."""
        return tuple(self._states)

    @property
    def timelines(self) -> tuple[ComputeTimeline, ...]:
        """The current compute timeline of every class, in :attr:`classes` order."""
        return tuple(s.timeline for s in self._states)

    def plan(self, kind: str) -> KindState:
        """The current plan of ``kind`` (op index -> config; missing ops follow the policy)."""
        return self._state[kind]

    def tensor_peak_bytes(self, kind: str) -> float:
        """The largest per-rank peak tensor memory among ``kind``'s ranks."""
        return max(s.memory_bytes for s, (name, _) in zip(self._states, self.classes)
                   if name == kind)

    def propose(self, kind: str, changes: Mapping[int, object]) -> Proposal:
        """Evaluate ``kind``'s plan with ``changes`` applied (None removes an op's entry).

        Nothing changes until :meth:`accept`.
        """
        plan = dict(self._state[kind])
        parsed = {op: None if p is None else OpPrecision.parse(p) for op, p in changes.items()}
        for op, config in parsed.items():
            if config is None:
                plan.pop(op, None)
            else:
                plan[op] = config
        key = self._memo.changed_key(self._keys[kind], self._state[kind], parsed)
        return self._propose(kind, plan, key, parsed)

    def propose_plan(self, kind: str, plan: Mapping[int, object]) -> Proposal:
        """Evaluate ``kind`` running ``plan`` (op index -> precision) instead of its current one."""
        plan = _parsed(plan)
        return self._propose(kind, plan, self._memo.plan_key(plan), None)

    def _propose(self, kind: str, plan: dict[int, OpPrecision], key: frozenset,
                 changes: Mapping[int, OpPrecision | None] | None) -> Proposal:
        """The proposal of ``plan`` (memo key ``key``), which is the kind's current plan
        with ``changes`` applied (None: any plan)."""
        positions = [i for i, (name, _) in enumerate(self.classes) if name == kind]
        states = list(self._states)
        for i in positions:
            states[i] = self._class(kind, self.classes[i][1], plan, key,
                                    base=None if changes is None else self._states[i],
                                    changes=changes)
        _, iteration_us = self._replay([s.timeline for s in states])
        return Proposal(kind, MappingProxyType(plan), iteration_us,
                        max(states[i].memory_bytes for i in positions),
                        tuple(states[i] for i in positions), key)

    def memory_bytes(self, kind: str, plan: Mapping[int, object]) -> float:
        """The largest per-rank peak tensor memory of ``kind`` if it ran ``plan`` (no
        timeline)."""
        plan = _parsed(plan)

        def compute() -> float:
            assignment = resolve_precisions(self.prepared.work, plan, self.devices[kind])
            return max(float(sum(self._memory(assignment, kind, batch).values()))
                       for name, batch in self.classes if name == kind)

        return self._memo.get(("memory", kind, self._memo.plan_key(plan)), compute)

    def accept(self, proposal: Proposal) -> None:
        """Make ``proposal`` the current state of its kind."""
        positions = [i for i, (name, _) in enumerate(self.classes) if name == proposal.kind]
        for i, state in zip(positions, proposal.states):
            self._states[i] = state
        self._state[proposal.kind], self._keys[proposal.kind] = proposal.plan, proposal.key
        self.replay, self.iteration_us = self._replay([s.timeline for s in self._states])

    def pace_us(self, kind: str) -> float:
        """The iteration time if every rank's forward and backward ran like ``kind`` in full
        precision (fp32, at the rank's batch size). Allreduces, unpacks and each rank's own
        optimizer step stay as they are: no precision plan changes them."""
        return self._memo.get(("pace", kind), lambda: self._pace_us(kind))

    def _pace_us(self, kind: str) -> float:
        assignment = resolve_precisions(self.prepared.work, {}, self.devices[kind])
        lines = {batch: self._builder(kind, batch).timeline(assignment)
                 for batch in {b for _, b in self.classes}}
        return self._replay([lines[batch] for _, batch in self.classes])[1]

    def _class(self, kind: str, batch: int, plan: KindState, key: frozenset, *,
               base: ClassState | None = None,
               changes: Mapping[int, OpPrecision | None] | None = None) -> ClassState:
        """The class of ``kind`` at ``batch`` under ``plan`` (memo key ``key``), from the
        memo, else evaluated: from ``base`` (its state under the plan that ``changes`` turn
        into ``plan``) when given, re-resolving and re-timing only what the changes touch."""
        return self._memo.get(("class", kind, batch, key),
                              lambda: self._new_class(kind, batch, plan, base, changes))

    def _new_class(self, kind: str, batch: int, plan: KindState, base: ClassState | None,
                   changes: Mapping[int, OpPrecision | None] | None) -> ClassState:
        work, device, builder = self.prepared.work, self.devices[kind], self._builder(kind, batch)
        if base is None:
            assignment = resolve_precisions(work, plan, device)
            timeline = builder.timeline(assignment)
        else:
            assignment, touched = re_resolve(work, base.assignment, changes, device)
            timeline = builder.timeline(assignment, base=base.timeline, touched=touched)
        return ClassState(assignment, timeline, self._memory(assignment, kind, batch))

    def _builder(self, kind: str, batch: int) -> TimelineBuilder:
        """The timeline builder of ``kind`` at ``batch`` (shared with the forks)."""
        if (kind, batch) not in self._builders:
            self._builders[(kind, batch)] = TimelineBuilder(
                self.prepared.work, self.costs, self.devices[kind], batch_size=batch,
                ddp=self.ddp)
        return self._builders[(kind, batch)]

    def _memory(self, assignment: PrecisionAssignment, kind: str,
                batch: int) -> dict[str, float]:
        return self.memory_model.breakdown(assignment, batch_size=batch,
                                           emulated=self.devices[kind].emulated)

    def _replay(self, timelines: list[ComputeTimeline]) -> tuple[AllreduceReplay, float]:
        """The allreduce stream, then each class's unpack and optimizer step."""
        replay = replay_allreduces([line.bucket_ready_us for line in timelines],
                                   [line.backward_end_us for line in timelines],
                                   [c.cost.us for c in self.comm], self._shared)
        end_us = float(max(tail_end_us(max(end, replay.end_us), *tail)
                           for end, tail in zip(replay.backward_end_us, self.tails)))
        return replay, end_us


def _parsed(plan: Mapping[int, object]) -> dict[int, OpPrecision]:
    """``plan`` with configs for values (they key the memo: equal configs compute the same
    way)."""
    return {op: OpPrecision.parse(p) for op, p in plan.items()}


def _ddp_work(prepared: PreparedGraph, cluster: Cluster, costs: CostModel) -> DdpWork | None:
    """What DDP adds to every rank's compute stream; None on one rank."""
    if cluster.world_size == 1:
        return None
    broadcast = (costs.broadcast_time_us(prepared.graph.buffer_bytes, cluster.world_size,
                                         cluster.ring_links())
                 if prepared.graph.buffer_bytes else None)
    return DdpWork(broadcast, prepared.bucket_ops, prepared.bucket_bytes)


def _tail_costs(prepared: PreparedGraph, cluster: Cluster, costs: CostModel, device,
                optimizer: str) -> tuple[Cost | None, Cost]:
    """A rank's costs after the backward: the bucket unpack (None on one rank) and the
    optimizer step. They do not depend on the precision plan (gradients are fp32)."""
    unpack = (copy_time_us(float(prepared.bucket_bytes.sum()), costs, device)
              if cluster.world_size > 1 and len(prepared.bucket_bytes) else None)
    return unpack, costs.optimizer_time_us(prepared.grad_param_bytes, optimizer, device)
