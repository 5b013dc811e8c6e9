"""``CostModel``: how long each op, cast, allreduce and optimizer step takes, and why.

Every answer carries its source, in this order of preference:

1. ``profile:<file>`` — a measured row for this (device, op FQN or kind + shapes,
   precision, phase, batch size);
2. ``fit:<file>`` — the roofline with efficiencies calibrated on that device's measured
   rows, or a cast line fitted to measured casts; ``floor:<file>`` where the op's time is
   the least time measured rows of its kind and precision take (fixed costs, casts
   included, :func:`~qsync_lab.costs.calibrate_efficiency`), not its work;
3. ``roofline`` — the catalog's peaks and bandwidth with the initial efficiency table, or
   the catalog's measured efficiencies where the device has them;
4. ``alpha-beta:<link>`` — allreduces, from the catalog link, or from the link's measured
   α–β fit (``link_fits``, :func:`qsync_lab.costs.read_link_fits`) when the model has one.

The model is a plain frozen object: build one, pass it to the simulator; nothing global.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.graph import trace_graph
    >>> from qsync_lab.devices import load_catalog
    >>> from qsync_lab.costs import op_work
    >>> work = op_work(trace_graph(nn.Linear(1024, 1024), torch.randn(64, 1024)))
    >>> v100 = load_catalog().device("V100-SXM2-32GB")
    >>> cost = CostModel().op_time_us(work, "linear", "fp16", v100, batch_size=64)
    >>> round(cost.us, 2), cost.source
    (8.28, 'roofline')
"""

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from qsync_lab.costs.calibrate import (CastFit, calibrate_efficiency, fit_cast_costs,
                                       fit_compression_costs)
from qsync_lab.costs.comm import broadcast_us, ring_allgather_us, ring_allreduce_us, slowest_link
from qsync_lab.costs.profiles import OP_PHASES, ProfileTable, read_profile
from qsync_lab.costs.roofline import Roofline, default_roofline
from qsync_lab.costs.work import OpWork, batch_scales, phase_work, shape_key
from qsync_lab.devices import DeviceCatalog, DeviceSpec, LinkSpec, load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.optimizers import optimizer_state_count
from qsync_lab.policy import PLANNABLE_KINDS, runs_natively
from qsync_lab.precision import Precision

#: suffix of a link's measured DDP buffer broadcast in ``link_fits``
BROADCAST_SUFFIX = "-ddp-broadcast"

__all__ = ["Cost", "CostModel"]

_CAST_KIND = "cast"
#: profile metadata keys (and CostModel fields) of the step-overhead fit
_OVERHEAD_KEYS = ("step_overhead_us", "event_overhead_us")
#: profile metadata key prefix of the per-op cost of low precision (``op_overhead_us.bf16``)
_OP_OVERHEAD_PREFIX = "op_overhead_us."
_OPTIMIZER_KIND = "optimizer"


@dataclass(frozen=True)
class Cost:
    """A duration and where it came from."""

    us: float
    source: str


@dataclass(frozen=True, eq=False)
class CostModel:
    """Operator, cast, allreduce and optimizer costs (see the module docstring).

    Attributes:
        rooflines: device name -> calibrated :class:`Roofline`; other devices use
            ``default_roofline`` with their catalog efficiencies.
        default_roofline: the roofline for uncalibrated devices.
        profiles: measured tables, searched in order; the first match wins.
        cast_fits: (device, src, dst) -> :class:`CastFit`.
        compress_fits: (device, compression spec, "encode"/"decode") -> :class:`CastFit`:
            the gradient compressors' measured time per call.
        link_fits: link name -> measured :class:`LinkSpec` replacing the catalog's link of
            that name in allreduces (its ``source`` names the fit).
        step_overhead_us: device name -> fixed cost per training step that isolated op
            timings miss (:mod:`qsync_lab.profile.overhead`, a profile's
            ``step_overhead_us`` metadata); one ``framework`` event per iteration.
        event_overhead_us: device name -> the same fit's correction per measured op event
            (may be negative; an event never drops below zero), added to its host time
            where the profile has one (a GPU's: the host's work between two ops).
        precision_op_overhead_us: (device name, precision) -> µs each measured forward event
            computed in that low precision adds: calibrated so that a model's measured DDP
            step under a uniform plan of it is simulated (a profile's
            ``op_overhead_us.<precision>`` metadata,
            :func:`qsync_lab.profile.overhead.ddp_calibrated_metadata`).
        casts_in_measured_ops: measured op times include the op's own casts (the runtime's
            ops cast their operands, and the profiler times them whole), so the simulator
            adds no cast events for a phase whose time is measured. False for tables of
            bare op times.
    """

    rooflines: Mapping[str, Roofline] = field(default_factory=dict)
    default_roofline: Roofline = field(default_factory=default_roofline)
    profiles: tuple[ProfileTable, ...] = ()
    cast_fits: Mapping[tuple[str, Precision, Precision], CastFit] = field(default_factory=dict)
    compress_fits: Mapping[tuple[str, str, str], CastFit] = field(default_factory=dict)
    link_fits: Mapping[str, LinkSpec] = field(default_factory=dict)
    step_overhead_us: Mapping[str, float] = field(default_factory=dict)
    event_overhead_us: Mapping[str, float] = field(default_factory=dict)
    precision_op_overhead_us: Mapping[tuple[str, Precision], float] = field(
        default_factory=dict)
    casts_in_measured_ops: bool = True

    @classmethod
    def from_profiles(cls, *paths: "str | os.PathLike[str]", catalog: DeviceCatalog | None = None,
                      calibrate: bool = True) -> "CostModel":
        """A cost model using measured profile CSVs: their rows override the roofline,
        their op rows calibrate each device's efficiencies (``calibrate=True``) and
        their cast rows fit the cast lines. For a device in several files the last
        file's calibration wins, and the first file's step overheads (a model's own
        profile, read first, carries the overheads of its own training step).

        Example::

            >>> CostModel.from_profiles().profiles
            ()
        """
        catalog = catalog if catalog is not None else load_catalog()
        tables = tuple(read_profile(p) for p in paths)
        rooflines: dict[str, Roofline] = {}
        cast_fits: dict[tuple[str, Precision, Precision], CastFit] = {}
        compress_fits: dict[tuple[str, str, str], CastFit] = {}
        overheads: dict[str, dict] = {key: {} for key in _OVERHEAD_KEYS}
        op_overheads: dict[tuple[str, Precision], float] = {}
        for table in tables:
            if "device" in table.metadata:
                device_name = catalog.device(table.metadata["device"]).name
                for key in _OVERHEAD_KEYS:
                    if key in table.metadata:
                        overheads[key].setdefault(device_name, _metadata_number(table, key))
                for key in table.metadata:
                    if key.startswith(_OP_OVERHEAD_PREFIX):
                        precision = Precision.parse(key.removeprefix(_OP_OVERHEAD_PREFIX))
                        op_overheads.setdefault((device_name, precision),
                                                _metadata_number(table, key))
            ops = table.frame[table.frame["phase"].isin(OP_PHASES)]
            if calibrate:
                for name in ops["device"].unique():
                    device = catalog.device(name)
                    rooflines[device.name] = calibrate_efficiency(ops, device,
                                                                  source=table.source)
            cast_fits.update(fit_cast_costs(table.frame, source=table.source))
            compress_fits.update(fit_compression_costs(table.frame, source=table.source))
        return cls(MappingProxyType(rooflines), profiles=tables,
                   cast_fits=MappingProxyType(cast_fits),
                   compress_fits=MappingProxyType(compress_fits),
                   precision_op_overhead_us=MappingProxyType(op_overheads),
                   **{key: MappingProxyType(values) for key, values in overheads.items()})

    def emulating(self, alias: str, device: str) -> "CostModel":
        """This model with device ``alias`` costed exactly as ``device`` (measured rows,
        calibrated roofline, cast fits): the costs of ``alias`` emulated on ``device``.

        Example::

            >>> from qsync_lab.resources import data_file
            >>> measured = CostModel.from_profiles(data_file("profiles", "cpu.csv"))
            >>> t4 = load_catalog().device("T4")
            >>> emulated = measured.emulating("T4", "cpu")
            >>> measured.roofline_for(t4).source, emulated.roofline_for(t4).source
            ('roofline', 'fit:profile:cpu.csv')
        """
        rooflines = dict(self.rooflines)
        if device in rooflines:
            rooflines[alias] = rooflines[device]
        cast_fits = dict(self.cast_fits)
        cast_fits.update({(alias, src, dst): fit for (name, src, dst), fit in
                          self.cast_fits.items() if name == device})
        compress_fits = dict(self.compress_fits)
        compress_fits.update({(alias, spec, step): fit for (name, spec, step), fit in
                              self.compress_fits.items() if name == device})
        overheads = {}
        for key in _OVERHEAD_KEYS:
            values = dict(getattr(self, key))
            if device in values:
                values[alias] = values[device]
            overheads[key] = MappingProxyType(values)
        op_overheads = dict(self.precision_op_overhead_us)
        op_overheads.update({(alias, p): us for (name, p), us in
                             self.precision_op_overhead_us.items() if name == device})
        return dataclasses.replace(
            self, rooflines=MappingProxyType(rooflines), cast_fits=MappingProxyType(cast_fits),
            compress_fits=MappingProxyType(compress_fits),
            profiles=tuple(table.aliased(alias, device) for table in self.profiles),
            precision_op_overhead_us=MappingProxyType(op_overheads), **overheads)

    def roofline_for(self, device: DeviceSpec) -> Roofline:
        """The calibrated roofline of ``device``, else the default one with the device's
        catalog efficiencies (:meth:`Roofline.for_device`)."""
        calibrated = self.rooflines.get(device.name)
        return calibrated if calibrated is not None else self.default_roofline.for_device(device)

    def op_times_us(self, work: OpWork, precisions: Sequence["Precision | str"],
                    device: DeviceSpec, *, batch_size: int, phase: str,
                    plan_precisions: Sequence["Precision | str"] | None = None
                    ) -> tuple[np.ndarray, list[str]]:
        """Time and source of every op of ``work`` in ``phase`` (vectorized).

        Args:
            work: from :func:`qsync_lab.costs.op_work`.
            precisions: per op, the precision ``phase`` computes in.
            device: the device kind.
            batch_size: the per-rank batch size.
            phase: ``forward``, ``backward_input`` or ``backward_weight``.
            plan_precisions: per op, the precision the plan gives it (the key of measured
                rows: an int8 op's fp16 backward is not an fp16 op's); default ``precisions``.
        """
        keys = precisions if plan_precisions is None else plan_precisions
        flops, nbytes = phase_work(work, precisions, phase, batch_size=batch_size)
        roofline = self.roofline_for(device)
        times = roofline.times_us(flops, nbytes, work.kinds, device, precisions)
        emulated = _emulated_on_gpu(work, keys, device)
        if emulated.any():
            times = np.where(emulated, self._emulated_times_us(work, keys, device, batch_size,
                                                               phase), times)
        floor_source = "floor:" + roofline.source.removeprefix("fit:")
        floored = roofline.floored(flops, nbytes, work.kinds, device, precisions) & ~emulated
        sources = [floor_source if f else roofline.source for f in floored]
        tables = [t for t in self.profiles if any(k[0] == device.name for k in t.by_op)
                  or any(k[0] == device.name for k in t.by_shape)]
        if tables:
            for i, name in enumerate(work.names):
                if not (flops[i] > 0 or nbytes[i] > 0):
                    continue
                key = shape_key(work, i, batch_size)
                for table in tables:
                    found = table.op_time_us(device.name, name, str(Precision.parse(
                        keys[i])), phase, batch_size, key)
                    if found is not None:
                        times[i], sources[i] = found, table.source
                        break
        return times, sources

    def op_host_times_us(self, work: OpWork, device: DeviceSpec, *, batch_size: int, phase: str,
                         plan_precisions: Sequence["Precision | str"]) -> np.ndarray:
        """Per op of ``work``, the host's time to issue ``phase`` on ``device`` (a GPU; the
        device runs it asynchronously), from the first profile with host times there
        (:meth:`~qsync_lab.costs.ProfileTable.op_host_us`: the op's row, else the median of
        its kind, else of its precision and phase); NaN where no profile has one: no host
        term (the CPU's ops are the host's work; profiles written before ``host_us``).

        Example::

            >>> import torch, torch.nn as nn
            >>> from qsync_lab.graph import trace_graph
            >>> from qsync_lab.costs import op_work
            >>> work = op_work(trace_graph(nn.Linear(8, 8), torch.randn(4, 8)))
            >>> h100 = load_catalog().device("H100-SXM5-80GB")
            >>> CostModel().op_host_times_us(work, h100, batch_size=4, phase="forward",
            ...                              plan_precisions=["fp32"]).tolist()
            [nan]
        """
        host = np.full(len(work), np.nan)
        tables = [t for t in self.profiles if any(k[0] == device.name for k in t.host_by_kind)]
        for i, name in enumerate(work.names if tables else ()):
            key, plan = shape_key(work, i, batch_size), str(Precision.parse(plan_precisions[i]))
            for table in tables:
                found = table.op_host_us(device.name, name, plan, phase, batch_size, key)
                if found is not None:
                    host[i] = found
                    break
        return host

    def _emulated_times_us(self, work: OpWork, keys: Sequence["Precision | str"],
                           device: DeviceSpec, batch_size: int, phase: str) -> np.ndarray:
        """What a GPU's emulation of each op costs (:func:`~qsync_lab.policy.runs_natively`
        is False): the fp32 work, plus encoding its operands to the plan's precision."""
        fp32 = [Precision.FP32] * len(work)
        flops, nbytes = phase_work(work, fp32, phase, batch_size=batch_size)
        roofline = self.roofline_for(device)
        times = roofline.times_us(flops, nbytes, work.kinds, device, fp32)
        operands = (work.act_read_bytes * batch_scales(work, batch_size)
                    + work.weight_read_bytes) / 4
        for precision in set(map(Precision.parse, keys)) - {Precision.FP32}:
            mask = np.array([Precision.parse(k) is precision for k in keys])
            encode, _ = self.cast_times_us(operands[mask], Precision.FP32, precision, device)
            times[mask] += encode
        return times

    def op_time_us(self, work: OpWork, op: str, precision: "Precision | str",
                   device: DeviceSpec, *, batch_size: int, phase: str = "forward") -> Cost:
        """Time of one op (FQN ``op``) in ``phase`` at ``precision`` and ``batch_size``."""
        index = work.index_of(op)
        precisions = [Precision.FP32] * len(work)
        precisions[index] = Precision.parse(precision)
        times, sources = self.op_times_us(work, precisions, device, batch_size=batch_size,
                                          phase=phase)
        return Cost(float(times[index]), sources[index])

    def cast_time_us(self, numel: float, src: "Precision | str", dst: "Precision | str",
                     device: DeviceSpec) -> Cost:
        """Time to convert ``numel`` elements from ``src`` to ``dst`` on ``device``.

        A fitted line when the profiles measured this pair on this device, else the
        roofline: read ``numel`` elements in ``src``, write them in ``dst``, plus a launch.

        Example::

            >>> t4 = load_catalog().device("T4")
            >>> CostModel().cast_time_us(32e6, "fp32", "fp16", t4)   # 192 MB at 256 GB/s
            Cost(us=755.0, source='roofline')
        """
        times, source = self.cast_times_us(np.array([float(numel)]), src, dst, device)
        return Cost(float(times[0]), source)

    def cast_times_us(self, numel: np.ndarray, src: "Precision | str", dst: "Precision | str",
                      device: DeviceSpec) -> tuple[np.ndarray, str]:
        """:meth:`cast_time_us` for many tensors of one (src, dst) pair at once."""
        src, dst = Precision.parse(src), Precision.parse(dst)
        fit = self.cast_fits.get((device.name, src, dst))
        if fit is not None:
            return fit.time_us(numel), fit.source
        roofline = self.roofline_for(device)
        nbytes = numel * (src.bits + dst.bits) / 8
        times = roofline.times_us(np.zeros(len(numel)), nbytes, [_CAST_KIND] * len(numel),
                                  device, [Precision.FP32] * len(numel))
        return times, roofline.source

    def allreduce_time_us(self, nbytes: float, ranks: int, links: Sequence[LinkSpec]) -> Cost:
        """Ring allreduce of ``nbytes`` over ``ranks`` ranks, limited by the slowest link.

        Example::

            >>> link = load_catalog().link("eth_100g")
            >>> CostModel().allreduce_time_us(100e6, 2, [link])   # 100 MB at 12.5 GB/s + 2 x 20 us
            Cost(us=8040.0, source='alpha-beta:eth_100g')
        """
        if ranks == 1:
            return Cost(0.0, "single rank")
        links, source = self._links(links)
        return Cost(ring_allreduce_us(nbytes, ranks, links), source)

    def allgather_time_us(self, nbytes: float, ranks: int, links: Sequence[LinkSpec]) -> Cost:
        """Ring all-gather of ``nbytes`` from every rank, limited by the slowest link.

        Example::

            >>> link = load_catalog().link("eth_100g")
            >>> CostModel().allgather_time_us(25e6, 2, [link])   # 2 ms + 20 us
            Cost(us=2020.0, source='alpha-beta:eth_100g')
        """
        if ranks == 1:
            return Cost(0.0, "single rank")
        links, source = self._links(links)
        return Cost(ring_allgather_us(nbytes, ranks, links), source)

    def compression_time_us(self, spec: str, step: str, numel: float, bytes_per_element: float,
                            device: DeviceSpec) -> Cost:
        """One gradient compressor's ``step`` ("encode", or "decode" of one rank's payload)
        over ``numel`` elements on ``device``: a fitted line where the profiles measured this
        spec (its cost label, e.g. "global_qsgd:8"), else the roofline of
        ``bytes_per_element`` read and written, plus a launch.

        Example::

            >>> t4 = load_catalog().device("T4")
            >>> CostModel().compression_time_us("cgx:4", "encode", 32e6, 8.5, t4)
            Cost(us=1067.5, source='roofline')
        """
        fit = self.compress_fits.get((device.name, spec, step))
        if fit is not None:
            return Cost(float(fit.time_us(numel)), fit.source)
        roofline = self.roofline_for(device)
        times = roofline.times_us(np.zeros(1), np.array([numel * bytes_per_element]),
                                  [_CAST_KIND], device, [Precision.FP32])
        return Cost(float(times[0]), roofline.source)

    def compression_in_step_us(self, spec: str, numel: float, device: DeviceSpec) -> Cost:
        """What one compressed group call of ``numel`` elements adds to a real DDP step
        beyond the composed estimate (the profile's ``in_step`` line for ``spec``, fitted on
        calibration steps; may be negative), or 0 where nothing was measured.

        Example::

            >>> CostModel().compression_in_step_us("cgx:4", 1e6, load_catalog().device("cpu"))
            Cost(us=0.0, source='not measured')
        """
        fit = self.compress_fits.get((device.name, spec, "in_step"))
        if fit is None:
            return Cost(0.0, "not measured")
        return Cost(float(fit.a_us_per_element * numel + fit.b_us), fit.source)

    def broadcast_time_us(self, nbytes: float, ranks: int, links: Sequence[LinkSpec]) -> Cost:
        """Broadcast of ``nbytes`` from one rank to the others (DDP's buffers), over the
        slowest of ``links``: a measured DDP buffer broadcast where the profile has one for
        each link (``<link>-ddp-broadcast``, :func:`qsync_lab.profile.fit_buffer_broadcast`),
        else measured link fits in place of catalog links, as for allreduces.

        Example::

            >>> link = load_catalog().link("eth_100g")
            >>> CostModel().broadcast_time_us(1.25e6, 2, [link])   # 20 us + 1.25 MB at 12.5 GB/s
            Cost(us=120.0, source='alpha-beta:eth_100g')
        """
        fitted = [self.link_fits.get(f"{link.name}{BROADCAST_SUFFIX}") for link in links]
        if links and all(fitted):  # DDP's buffer broadcast measured on these links
            slowest = slowest_link(fitted)
            return Cost(broadcast_us(nbytes, ranks, fitted),
                        f"alpha-beta:{slowest.name} ({slowest.source})")
        links, source = self._links(links)
        return Cost(broadcast_us(nbytes, ranks, links), source)

    def _links(self, links: Sequence[LinkSpec]) -> tuple[list[LinkSpec], str]:
        """``links`` with measured fits in place of catalog links, and the source label of
        a collective over them (the slowest link, and its fit when it was measured)."""
        links = [self.link_fits.get(link.name, link) for link in links]
        slowest = slowest_link(links)
        fitted = slowest.name in self.link_fits
        return links, f"alpha-beta:{slowest.name}" + (f" ({slowest.source})" if fitted else "")

    def optimizer_time_us(self, param_bytes: float, optimizer: str, device: DeviceSpec) -> Cost:
        """One optimizer step over ``param_bytes`` of fp32 parameters (memory-bound: the
        runtime's non-finite check reads the gradients, then the step reads parameters,
        gradients and state and writes parameters and state).

        Example::

            >>> v100 = load_catalog().device("V100-SXM2-32GB")
            >>> cost = CostModel().optimizer_time_us(440e6, "adam", v100)
            >>> round(cost.us, 1), cost.source   # 8 x 440 MB at 720 GB/s, plus a launch
            (4893.9, 'roofline')
        """
        states = optimizer_state_count(optimizer)
        roofline = self.roofline_for(device)
        traffic = (4 + 2 * states) * param_bytes
        times = roofline.times_us(np.zeros(1), np.array([float(traffic)]), [_OPTIMIZER_KIND],
                                  device, [Precision.FP32])
        return Cost(float(times[0]), roofline.source)


def _metadata_number(table: ProfileTable, key: str) -> float:
    """The leading number of a ``key: <number>; ...`` metadata line."""
    text = table.metadata[key].split(";", 1)[0].strip()
    try:
        return float(text)
    except ValueError:
        raise QSyncError(f"{table.source}: metadata {key!r} must start with a number, "
                         f"got {table.metadata[key]!r}") from None


def _emulated_on_gpu(work: OpWork, precisions: Sequence["Precision | str"],
                     device: DeviceSpec) -> np.ndarray:
    """Per op, whether ``device`` (a GPU) emulates it in its plan precision."""
    if device.emulated:
        return np.zeros(len(work), bool)
    native = {}
    for kind, precision in zip(work.kinds, precisions):
        pair = (kind, Precision.parse(precision))
        if pair not in native:
            native[pair] = (pair[1] is Precision.FP32 or pair[0] not in PLANNABLE_KINDS
                            or runs_natively(*pair, device))
    return np.array([not native[(k, Precision.parse(p))]
                     for k, p in zip(work.kinds, precisions)], bool)
