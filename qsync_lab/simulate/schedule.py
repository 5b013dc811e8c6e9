"""The compute stream of one rank: forward, casts and backward, in order.

Order of events (one compute stream, so each starts once the previous one ends):

* forward, ops in graph order: for an op whose inputs arrive in another storage precision,
  one cast per source precision (``cast:<op>:<src>-><dst>``, data inputs are fp32); for a
  weighted op not stored in fp32, the weight cast from the fp32 master copy
  (``cast:<op>:weight:fp32-><p>``); then the op.
* backward, ops in reverse order: an int8 op first casts its fp32 output gradient and
  dequantises its saved int8 tensors to fp16 (``grad_out``/``saved`` casts); then the
  input gradient (``backward_input``); then, mirroring each forward input cast, the
  gradient cast back to the producer's precision (``cast:<op>:grad:<q>-><src>``); then
  the weight gradient (``backward_weight``) and, when it is not fp32, its cast to the
  fp32 gradient (``cast:<op>:weight_grad:<q>->fp32``). An op's parameter gradients are
  ready when the last of these ends.
* on several ranks, DDP's work (:mod:`qsync_lab.simulate.sync`): the buffer broadcast
  before the forward, and each gradient bucket's pack right after the backward event that
  completes it.

View ops alias their input and produce no events. Ops with no work in a phase produce no
event for it. A runtime op casts its own operands, so a time measured by the profiler
(source ``profile:…``) already holds them: the casts of a phase whose op time is measured
are not added again (unless ``CostModel.casts_in_measured_ops`` is False). When the
rank's op times are measured, the fitted framework costs apply: a ``framework`` event of
``CostModel.step_overhead_us`` opens the iteration, and each measured op event gets
``CostModel.event_overhead_us`` (a measured forward computed in a low precision also
``CostModel.precision_op_overhead_us``).

Where the profile measured a GPU's host times (:meth:`CostModel.op_host_times_us`), the
stream runs as eager PyTorch runs it: the host issues the events one after the other,
each taking its host time, and the device starts an event once the host has started
issuing it and the device has finished the one before: ``start[i] = max(issue[i],
end[i-1])``, ``issue[i+1] = issue[i] + host[i]``. A host slower than the device (small
ops, many kernels) then sets the pace, a device slower than the host does, and the
stream ends when both are done. The fitted framework costs are host work there (the
``framework`` event's host time is its duration; the per-event overheads are added to
the host times). Events without a host time (casts, DDP's copies, the CPU's ops, old
profiles) take none: back to back, as before; an op costed from the least time of its
kind (source ``floor:…``, :func:`~qsync_lab.costs.calibrate_efficiency`) holds its casts
as a measured one.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.costs import CostModel, op_work
    >>> from qsync_lab.devices import load_catalog
    >>> from qsync_lab.graph import trace_graph
    >>> from qsync_lab.policy import resolve_precisions
    >>> work = op_work(trace_graph(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
    ...                            torch.randn(2, 4)))
    >>> t4 = load_catalog().device("T4")
    >>> line = compute_timeline(work, resolve_precisions(work, {"1": "fp16"}, t4),
    ...                         CostModel(), t4, batch_size=2)
    >>> [op for op, cat in zip(line.events.op, line.events.category) if cat == "cast"]
    ['cast:1:fp32->fp16', 'cast:1:weight:fp32->fp16', 'cast:1:grad:fp16->fp32', 'cast:1:weight_grad:fp16->fp32']

An op's events depend only on its own precisions and those its inputs arrive in, so a
:class:`TimelineBuilder` that builds many timelines of one rank class (the allocator's
trials) derives each op's events once per such context and reuses them; the events are
named only when first read::

    >>> builder = TimelineBuilder(work, CostModel(), t4, batch_size=2)
    >>> again = builder.timeline(resolve_precisions(work, {"1": "fp16"}, t4))
    >>> again.dur_us.tolist() == line.dur_us.tolist()
    True

Host times change the starts, not the durations (:func:`eager_starts`)::

    >>> eager_starts(np.array([5.0, 5.0, 30.0]), np.array([20.0, 20.0, 10.0]))
    (array([ 0., 20., 40.]), 70.0)
"""

import functools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from qsync_lab.costs import CostModel, OpWork, batch_scales, phase_work
from qsync_lab.devices import DeviceSpec
from qsync_lab.precision import Precision
from qsync_lab.simulate.events import StreamEvents
from qsync_lab.policy import PrecisionAssignment, storage_precision
from qsync_lab.simulate.sync import DdpWork, copy_time_us

__all__ = ["ComputeTimeline", "TimelineBuilder", "compute_timeline", "eager_starts"]

_FP32_BYTES = 4


class _Segment:
    """Consecutive events: rows ``[op, fqn, category, phase, precision, plan, bytes,
    source]`` with their durations and host times, and the buckets packed by its events
    (per bucket, its pack's position in the segment)."""

    __slots__ = ("rows", "dur_us", "host_us", "packs")

    def __init__(self) -> None:
        self.rows: list[list] = []
        self.dur_us: list[float] = []
        self.host_us: list[float] = []
        self.packs: list[tuple[int, int]] = []

    def add(self, op, fqn, category, phase, precision, plan, dur_us, nbytes, source,
            host_us: float = 0.0) -> None:
        self.rows.append([op, fqn, category, phase, precision, plan, nbytes, source])
        self.dur_us.append(dur_us)
        self.host_us.append(host_us)


@dataclass(frozen=True, eq=False)
class ComputeTimeline:
    """The compute stream of one (device kind, batch size, plan) class of ranks.

    Attributes:
        dur_us: per event, its duration.
        start_us: per event, its start (back to back from 0 without host times,
            :func:`eager_starts`).
        bucket_ready_us: per DDP bucket, when it is packed and ready for its allreduce
            (empty on one rank).
        backward_end_us: when the last backward event ends and the host has issued it.
    """

    dur_us: np.ndarray
    start_us: np.ndarray
    bucket_ready_us: np.ndarray
    backward_end_us: float
    _segments: tuple[_Segment, ...] = field(repr=False)
    _ops: tuple[tuple[_Segment, _Segment], ...] = field(repr=False)  # per op: fwd, bwd

    @functools.cached_property
    def events(self) -> StreamEvents:
        """The events, in stream order."""
        rows = [row for segment in self._segments for row in segment.rows]
        if not rows:
            return StreamEvents.empty()
        op, fqn, category, phase, precision, plan, nbytes, source = zip(*rows)
        return StreamEvents.from_lists(op, fqn, category, phase, precision, plan, source,
                                       self.start_us, self.dur_us, nbytes)

    @property
    def busy_us(self) -> float:
        return float(self.dur_us.sum())


def compute_timeline(work: OpWork, assignment: PrecisionAssignment, costs: CostModel,
                     device: DeviceSpec, *, batch_size: int,
                     ddp: DdpWork | None = None) -> ComputeTimeline:
    """Build the compute stream of one rank class (see the module docstring).

    Args:
        work: the graph's :class:`~qsync_lab.costs.OpWork`.
        assignment: the per-op precisions of this device kind.
        costs: the cost model.
        device: the device kind.
        batch_size: the per-rank batch size.
        ddp: DDP's work on several ranks (:class:`~qsync_lab.simulate.sync.DdpWork`);
            None on one rank.
    """
    return TimelineBuilder(work, costs, device, batch_size=batch_size,
                           ddp=ddp).timeline(assignment)


class TimelineBuilder:
    """:func:`compute_timeline` of one rank class for many assignments: each op's events
    are derived once per precision context (its precisions, its inputs') and reused."""

    def __init__(self, work: OpWork, costs: CostModel, device: DeviceSpec, *,
                 batch_size: int, ddp: DdpWork | None = None) -> None:
        self.work, self.costs, self.device, self.batch_size = work, costs, device, batch_size
        self._scale = batch_scales(work, batch_size)
        # (op, its float producers) of every op that is not a view (views have no events)
        self._computed = tuple((i, tuple(j for j in work.producers[i] if work.float_output[j]))
                               for i, kind in enumerate(work.kinds) if kind != "view")
        self._slots = {i: slot for slot, (i, _) in enumerate(self._computed)}
        self._phases: dict[tuple, tuple] = {}
        self._ops: dict[tuple, tuple[_Segment, _Segment]] = {}
        self._pending: dict[tuple[Precision, Precision], list[tuple[_Segment, int, float]]] = (
            defaultdict(list))
        self._broadcast = _Segment()
        broadcast = ddp.broadcast if ddp is not None else None
        if broadcast is not None and broadcast.us > 0:
            self._broadcast.add("ddp:broadcast_buffers", "", "broadcast", "forward", "", "",
                                broadcast.us, 0.0, broadcast.source)
        self._framework = _Segment()
        step_overhead = costs.step_overhead_us.get(device.name, 0.0)
        if step_overhead > 0:
            self._framework.add("framework", "", "framework", "forward", "", "",
                                step_overhead, 0.0, "fit:step overhead", host_us=step_overhead)
        self._backward_order = self._backward_slots(ddp)

    def timeline(self, assignment: PrecisionAssignment, *, base: ComputeTimeline | None = None,
                 touched: Iterable[int] = ()) -> ComputeTimeline:
        """The compute stream under ``assignment``; with ``base``, the timeline of an
        assignment that differs from it only in the precisions of the ``touched`` ops and
        of their producers (:func:`~qsync_lab.policy.re_resolve`'s second result)."""
        if base is None:
            ops = [self._op_pair(assignment, i, producers) for i, producers in self._computed]
        else:
            ops = list(base._ops)
            for slot in (self._slots[i] for i in touched if i in self._slots):  # views: none
                ops[slot] = self._op_pair(assignment, *self._computed[slot])
        self._fill_casts()
        framework = [self._framework] if self._measured_forward(assignment.precision) else []
        ordered = [self._broadcast, *framework, *[forward for forward, _ in ops]]
        ordered += [ops[slot][1] if isinstance(slot, int) else slot
                    for slot in self._backward_order]
        return _assemble(tuple(ordered), tuple(ops))

    def _op_pair(self, assignment: PrecisionAssignment, i: int,
                 producers: tuple[int, ...]) -> tuple[_Segment, _Segment]:
        """Op ``i``'s forward and backward events under ``assignment`` (``producers``: the
        ops whose float outputs it reads)."""
        out = assignment.output
        key = (i, assignment.precision[i], assignment.backward[i],
               tuple([out[j] for j in producers]))
        return self._ops.get(key) or self._op_segments(*key, producers)

    def _measured_forward(self, fwd: tuple[Precision, ...]) -> bool:
        """Whether the framework cost opens the iteration: it is fitted and some op's
        forward time is measured."""
        return bool(self._framework.rows) and any(
            self._phase("forward", p, p)[2][i].startswith("profile:") for i, p in enumerate(fwd))

    def _phase(self, phase: str, precision: Precision, plan: Precision) -> tuple:
        """Per op: (time, host time, source, bytes, casts inside) of ``phase`` computed in
        ``precision`` for an op planned in ``plan``."""
        key = (phase, precision, plan)
        if key not in self._phases:
            work, costs, device, n = self.work, self.costs, self.device, len(self.work)
            times, sources = costs.op_times_us(work, [precision] * n, device,
                                               batch_size=self.batch_size, phase=phase,
                                               plan_precisions=[plan] * n)
            host = costs.op_host_times_us(work, device, batch_size=self.batch_size,
                                          phase=phase, plan_precisions=[plan] * n)
            _, nbytes = phase_work(work, [precision] * n, phase, batch_size=self.batch_size)
            measured = np.array([s.startswith("profile:") for s in sources], bool)
            whole = measured | np.array([s.startswith("floor:") for s in sources], bool)
            overhead = costs.event_overhead_us.get(device.name, 0.0)
            if phase == "forward":
                overhead += costs.precision_op_overhead_us.get((device.name, precision), 0.0)
            # the overheads are the framework's work: the host's where the op has a host time
            hosted = ~np.isnan(host) & (times > 0)
            times = np.where(measured & (times > 0) & ~hosted, np.maximum(times + overhead, 0.0),
                             times)
            host = np.where(hosted, np.maximum(host + overhead, 0.0), 0.0)
            self._phases[key] = (times, host, sources, nbytes,
                                 whole & costs.casts_in_measured_ops)
        return self._phases[key]

    def _op_segments(self, i: int, p: Precision, q: Precision, outs: tuple[Precision, ...],
                     producers: tuple[int, ...]) -> tuple[_Segment, _Segment]:
        """Op ``i``'s forward and backward events, run in ``p`` and ``q`` with its float
        inputs (from ``producers``) arriving in ``outs``."""
        work, scale = self.work, self._scale
        stored = storage_precision(p)
        input_casts: dict[Precision, float] = defaultdict(float)
        for j, output in zip(producers, outs):
            if output is not stored:
                input_casts[output] += work.out_numel[j] * scale[j]
        segments = self._ops[(i, p, q, outs)] = (self._forward_segment(i, p, input_casts),
                                                 self._backward_segment(i, p, q, input_casts))
        return segments

    def _forward_segment(self, i: int, p: Precision,
                         input_casts: dict[Precision, float]) -> _Segment:
        """Op ``i``'s forward events: its input casts, its weight cast and the op."""
        work, scale, fqn = self.work, self._scale, self.work.names[i]
        times, host, sources, nbytes, casts_inside = self._phase("forward", p, p)
        stored = storage_precision(p)
        segment = _Segment()
        if not casts_inside[i]:
            for src, numel in input_casts.items():
                self._cast(segment, fqn, "", src, stored, numel, "forward", p)
            self._cast(segment, fqn, "", Precision.FP32, stored,
                       work.data_input_numel[i] * scale[i], "forward", p)
            self._cast(segment, fqn, "weight:", Precision.FP32, stored, work.weight_numel[i],
                       "forward", p)
        if times[i] > 0:
            segment.add(fqn, fqn, "op", "forward", str(p), str(p), times[i], nbytes[i],
                        sources[i], host[i])
        return segment

    def _backward_segment(self, i: int, p: Precision, q: Precision,
                          input_casts: dict[Precision, float]) -> _Segment:
        """Op ``i``'s backward events (forward in ``p``, backward in ``q``)."""
        work, scale, fqn = self.work, self._scale, self.work.names[i]
        stored_q = storage_precision(q)
        input_us, input_host, input_source, input_bytes, input_inside = (
            column[i] for column in self._phase("backward_input", q, p))
        weight_us, weight_host, weight_source, weight_bytes, weight_inside = (
            column[i] for column in self._phase("backward_weight", q, p))
        segment = _Segment()
        if p is Precision.INT8 and (input_us > 0 or weight_us > 0) and not (
                input_inside or weight_inside):
            self._cast(segment, fqn, "grad_out:", Precision.FP32, stored_q,
                       work.out_numel[i] * scale[i], "backward", p)
            saved_numel = work.act_read_bytes[i] * scale[i] / _FP32_BYTES + work.weight_numel[i]
            self._cast(segment, fqn, "saved:", Precision.INT8, stored_q, saved_numel,
                       "backward", p)
        if input_us > 0:
            segment.add(fqn, fqn, "op", "backward_input", str(q), str(p), input_us,
                        input_bytes, input_source, input_host)
        if not input_inside:
            for src, numel in input_casts.items():
                self._cast(segment, fqn, "grad:", stored_q, src, numel, "backward", p)
        if weight_us > 0:
            segment.add(fqn, fqn, "op", "backward_weight", str(q), str(p), weight_us,
                        weight_bytes, weight_source, weight_host)
            if not weight_inside:
                self._cast(segment, fqn, "weight_grad:", stored_q, Precision.FP32,
                           work.weight_numel[i], "backward", p)
        return segment

    def _cast(self, segment: _Segment, fqn: str, label: str, src: Precision, dst: Precision,
              numel: float, phase: str, plan: Precision) -> None:
        """A cast event; its duration is costed with the others of its (src, dst) pair."""
        if src is dst or numel <= 0:
            return
        self._pending[(src, dst)].append((segment, len(segment.rows), numel))
        segment.add(f"cast:{fqn}:{label}{src}->{dst}", fqn, "cast", phase, str(dst),
                    str(plan), np.nan, numel * (src.bits + dst.bits) / 8, "")

    def _fill_casts(self) -> None:
        """Cost the casts of the segments derived since the last call, per (src, dst)."""
        for (src, dst), entries in self._pending.items():
            times, source = self.costs.cast_times_us(np.array([n for _, _, n in entries]),
                                                     src, dst, self.device)
            for (segment, k, _), time_us in zip(entries, times.tolist()):
                segment.dur_us[k], segment.rows[k][7] = time_us, source
        self._pending.clear()

    def _backward_slots(self, ddp: DdpWork | None) -> list["int | _Segment"]:
        """The backward stream's order: ops in reverse (an int: the op's place among the
        ops that are not views), each followed by DDP's packs of the buckets its backward
        completes; the packs of buckets left to the end of the backward come last."""
        packs: dict[int | None, _Segment] = defaultdict(_Segment)
        for k in range(len(ddp.bucket_bytes) if ddp is not None else 0):
            nbytes = float(ddp.bucket_bytes[k])
            copy = copy_time_us(nbytes, self.costs, self.device)
            segment = packs[ddp.last_op(k)]
            segment.add(f"ddp:pack:bucket{k}", "", "ddp", "backward", "fp32", "fp32",
                        2 * copy.us, 2 * nbytes, copy.source)
            segment.packs.append((k, len(segment.rows)))
        slots: list[int | _Segment] = []
        for i in reversed(range(len(self.work))):
            slots += [self._slots[i]] if i in self._slots else []
            slots += [packs[i]] if i in packs else []
        return slots + ([packs[None]] if None in packs else [])


def _assemble(segments: tuple[_Segment, ...],
              ops: tuple[tuple[_Segment, _Segment], ...]) -> ComputeTimeline:
    """The timeline of ``segments`` run in order (``ops``: each op's, for re-use)."""
    durations: list[float] = []
    hosts: list[float] = []
    ready: dict[int, int] = {}
    for segment in segments:
        for k, position in segment.packs:
            ready[k] = len(durations) + position
        durations.extend(segment.dur_us)
        hosts.extend(segment.host_us)
    dur_us = np.array(durations, float)
    start_us, end_us = eager_starts(dur_us, np.array(hosts, float))
    ends = np.concatenate(([0.0], start_us + dur_us))  # a pack's mark: the position after it
    marks = np.array([ready[k] for k in range(len(ready))], dtype=np.int64)
    return ComputeTimeline(dur_us, start_us, ends[marks], end_us, segments, ops)


def eager_starts(dur_us: np.ndarray, host_us: np.ndarray) -> tuple[np.ndarray, float]:
    """Start of each event of a stream whose host issues event ``i`` for ``host_us[i]``
    and whose device runs it for ``dur_us[i]`` once the host has started issuing it and
    the device has finished the event before (module docstring); and when both are done.
    All host times 0: back to back. ``end[i] = max over j <= i of (issue[j] + dur[j] +
    ... + dur[i])``, a running maximum.

    Example::

        >>> eager_starts(np.array([1.0, 2.0]), np.zeros(2))
        (array([0., 1.]), 3.0)
    """
    if not len(dur_us):
        return dur_us.copy(), 0.0
    issue = np.concatenate(([0.0], np.cumsum(host_us)[:-1]))
    done_before = np.concatenate(([0.0], np.cumsum(dur_us)[:-1]))
    start_us = np.maximum.accumulate(issue - done_before) + done_before
    return start_us, float(max(start_us[-1] + dur_us[-1], issue[-1] + host_us[-1]))
