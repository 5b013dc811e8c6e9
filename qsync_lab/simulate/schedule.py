"""The compute stream of one rank: forward, casts and backward, back to back.

Order of events (one compute stream, so each starts when the previous one ends):

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
``CostModel.event_overhead_us``.

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
"""

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from qsync_lab.costs import CostModel, OpWork, batch_scales, phase_work
from qsync_lab.devices import DeviceSpec
from qsync_lab.precision import Precision
from qsync_lab.simulate.events import StreamEvents
from qsync_lab.policy import PrecisionAssignment, storage_precision
from qsync_lab.simulate.sync import DdpWork, copy_time_us

__all__ = ["ComputeTimeline", "compute_timeline"]

_FP32_BYTES = 4


@dataclass(frozen=True, eq=False)
class ComputeTimeline:
    """The compute stream of one (device kind, batch size, plan) class of ranks.

    Attributes:
        events: the events, back to back from 0.
        bucket_ready_us: per DDP bucket, when it is packed and ready for its allreduce
            (empty on one rank).
        backward_end_us: end of the last backward event.
    """

    events: StreamEvents
    bucket_ready_us: np.ndarray
    backward_end_us: float

    @property
    def busy_us(self) -> float:
        return float(self.events.dur_us.sum())


class _Builder:
    """Collects events in order; cast durations are filled in per (src, dst) pair at once."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.casts: dict[tuple[Precision, Precision], list[tuple[int, float]]] = defaultdict(list)

    def add(self, op, fqn, category, phase, precision, plan, dur_us, nbytes, source) -> None:
        self.rows.append((op, fqn, category, phase, precision, plan, dur_us, nbytes, source))

    def cast(self, fqn: str, label: str, src: Precision, dst: Precision, numel: float,
             phase: str, plan: Precision) -> None:
        if src is dst or numel <= 0:
            return
        self.casts[(src, dst)].append((len(self.rows), numel))
        self.rows.append((f"cast:{fqn}:{label}{src}->{dst}", fqn, "cast", phase, str(dst),
                          str(plan), np.nan, numel * (src.bits + dst.bits) / 8, ""))

    def mark(self) -> int:
        """How many events exist so far."""
        return len(self.rows)

    def finish(self, costs: CostModel, device: DeviceSpec) -> StreamEvents:
        if not self.rows:
            return StreamEvents.empty()
        op, fqn, category, phase, precision, plan, dur, nbytes, source = zip(*self.rows)
        dur_us = np.array(dur, float)
        source = list(source)
        for (src, dst), entries in self.casts.items():
            where = np.array([i for i, _ in entries])
            times, cast_source = costs.cast_times_us(np.array([n for _, n in entries]), src,
                                                     dst, device)
            dur_us[where] = times
            for i in where.tolist():
                source[i] = cast_source
        start_us = np.concatenate(([0.0], np.cumsum(dur_us)[:-1]))
        return StreamEvents.from_lists(op, fqn, category, phase, precision, plan, source,
                                       start_us, dur_us, nbytes)


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
    scale = batch_scales(work, batch_size)
    fwd, bwd = assignment.precision, assignment.backward
    timing = {}
    for phase, precisions in (("forward", fwd), ("backward_input", bwd),
                              ("backward_weight", bwd)):
        times, sources = costs.op_times_us(work, precisions, device, batch_size=batch_size,
                                           phase=phase, plan_precisions=fwd)
        _, nbytes = phase_work(work, precisions, phase, batch_size=batch_size)
        measured = np.array([s.startswith("profile:") for s in sources], bool)
        times = np.where(measured & (times > 0), np.maximum(
            times + costs.event_overhead_us.get(device.name, 0.0), 0.0), times)
        casts_inside = measured & costs.casts_in_measured_ops
        timing[phase] = (times, sources, nbytes, casts_inside)
    build = _Builder()
    broadcast = ddp.broadcast if ddp is not None else None
    if broadcast is not None and broadcast.us > 0:
        build.add("ddp:broadcast_buffers", "", "broadcast", "forward", "", "", broadcast.us, 0.0,
                  broadcast.source)
    step_overhead = costs.step_overhead_us.get(device.name, 0.0)
    if step_overhead > 0 and any(timing["forward"][3]):
        build.add("framework", "", "framework", "forward", "", "", step_overhead, 0.0,
                  "fit:step overhead")
    input_casts = _forward(build, work, assignment, scale, timing["forward"])
    packs = _Packs(ddp, costs, device)
    _backward(build, work, assignment, scale, timing, input_casts, packs)
    packs.add(build, None)
    events = build.finish(costs, device)
    ends = np.concatenate(([0.0], events.end_us))
    return ComputeTimeline(events, ends[packs.marks()], float(ends[-1]))


class _Packs:
    """DDP's bucket packs: added after the backward event that completes each bucket."""

    def __init__(self, ddp: DdpWork | None, costs: CostModel, device: DeviceSpec) -> None:
        self.by_op: dict[int | None, list[int]] = defaultdict(list)
        self.ddp, self.costs, self.device = ddp, costs, device
        self.ends: dict[int, int] = {}
        if ddp is not None:
            for k in range(len(ddp.bucket_bytes)):
                self.by_op[ddp.last_op(k)].append(k)

    def add(self, build: _Builder, op: int | None) -> None:
        """Pack the buckets ``op``'s backward completes (None: those left at the end)."""
        for k in self.by_op.get(op, ()):
            nbytes = float(self.ddp.bucket_bytes[k])
            copy = copy_time_us(nbytes, self.costs, self.device)
            build.add(f"ddp:pack:bucket{k}", "", "ddp", "backward", "fp32", "fp32",
                      2 * copy.us, 2 * nbytes, copy.source)
            self.ends[k] = build.mark()

    def marks(self) -> np.ndarray:
        """Per bucket, how many events exist once it is packed."""
        return np.array([self.ends[k] for k in range(len(self.ends))], dtype=np.int64)


def _forward(build: _Builder, work: OpWork, assignment: PrecisionAssignment,
             scale: np.ndarray, timing) -> dict[int, dict[Precision, float]]:
    """Forward events; returns, per op, the numel cast in from each producer precision."""
    times, sources, nbytes, casts_inside = timing
    input_casts: dict[int, dict[Precision, float]] = {}
    for i, fqn in enumerate(work.names):
        if work.kinds[i] == "view":
            continue
        p = assignment.precision[i]
        stored = storage_precision(p)
        from_producers: dict[Precision, float] = defaultdict(float)
        for j in work.producers[i]:
            if work.float_output[j] and assignment.output[j] is not stored:
                from_producers[assignment.output[j]] += work.out_numel[j] * scale[j]
        if not casts_inside[i]:
            for src, numel in from_producers.items():
                build.cast(fqn, "", src, stored, numel, "forward", p)
            build.cast(fqn, "", Precision.FP32, stored, work.data_input_numel[i] * scale[i],
                       "forward", p)
            build.cast(fqn, "weight:", Precision.FP32, stored, work.weight_numel[i],
                       "forward", p)
        if times[i] > 0:
            build.add(fqn, fqn, "op", "forward", str(p), str(p), times[i], nbytes[i],
                      sources[i])
        input_casts[i] = from_producers
    return input_casts


def _backward(build: _Builder, work: OpWork, assignment: PrecisionAssignment,
              scale: np.ndarray, timing, input_casts: dict[int, dict[Precision, float]],
              packs: _Packs) -> None:
    """Backward events, each bucket packed once its last gradient is final."""
    bin_times, bin_sources, bin_bytes, bin_inside = timing["backward_input"]
    bw_times, bw_sources, bw_bytes, bw_inside = timing["backward_weight"]
    for i in reversed(range(len(work))):
        if work.kinds[i] != "view":
            _op_backward(build, work, assignment, scale, i, input_casts[i],
                         (bin_times[i], bin_sources[i], bin_bytes[i], bin_inside[i]),
                         (bw_times[i], bw_sources[i], bw_bytes[i], bw_inside[i]))
        packs.add(build, i)


def _op_backward(build: _Builder, work: OpWork, assignment: PrecisionAssignment,
                 scale: np.ndarray, i: int, input_casts: dict[Precision, float],
                 grad_input: tuple, grad_weight: tuple) -> None:
    """Events of op ``i``'s backward; ``grad_*`` are (time_us, source, bytes, casts
    inside) of its phases."""
    fqn, p, q = work.names[i], assignment.precision[i], assignment.backward[i]
    stored_q = storage_precision(q)
    input_us, input_source, input_bytes, input_casts_inside = grad_input
    weight_us, weight_source, weight_bytes, weight_casts_inside = grad_weight
    if p is Precision.INT8 and (input_us > 0 or weight_us > 0) and not (
            input_casts_inside or weight_casts_inside):
        build.cast(fqn, "grad_out:", Precision.FP32, stored_q, work.out_numel[i] * scale[i],
                   "backward", p)
        saved_numel = work.act_read_bytes[i] * scale[i] / _FP32_BYTES + work.weight_numel[i]
        build.cast(fqn, "saved:", Precision.INT8, stored_q, saved_numel, "backward", p)
    if input_us > 0:
        build.add(fqn, fqn, "op", "backward_input", str(q), str(p), input_us, input_bytes,
                  input_source)
    if not input_casts_inside:
        for src, numel in input_casts.items():
            build.cast(fqn, "grad:", stored_q, src, numel, "backward", p)
    if weight_us > 0:
        build.add(fqn, fqn, "op", "backward_weight", str(q), str(p), weight_us, weight_bytes,
                  weight_source)
        if not weight_casts_inside:
            build.cast(fqn, "weight_grad:", stored_q, Precision.FP32, work.weight_numel[i],
                       "backward", p)
