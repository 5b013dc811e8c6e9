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

import numpy as np

from qsync_lab.costs.calibrate import CastFit
from qsync_lab.costs.collectives import BROADCAST_SUFFIX, broadcast_cost, ring_cost
from qsync_lab.costs.comm import ring_allgather_us, ring_allreduce_us
from qsync_lab.costs.cost import Cost
from qsync_lab.costs.device_fits import DEVICE_FIELDS, aliased, profile_fits
from qsync_lab.costs.emulation import emulated_on_gpu, emulated_times_us
from qsync_lab.costs.measured import measured_host_times, measured_op_times
from qsync_lab.costs.memory_bound import (cast_times_us, compression_cost, in_step_cost,
                                          optimizer_cost)
from qsync_lab.costs.profiles import ProfileTable, read_profile
from qsync_lab.costs.roofline import Roofline, default_roofline
from qsync_lab.costs.work import OpWork, phase_work
from qsync_lab.devices import DeviceCatalog, DeviceSpec, LinkSpec, load_catalog
from qsync_lab.precision import Precision

__all__ = ["BROADCAST_SUFFIX", "Cost", "CostModel"]


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
        return cls(profiles=tables, **profile_fits(tables, catalog, calibrate=calibrate))

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
        fits = {name: aliased(getattr(self, name), alias, device) for name in DEVICE_FIELDS}
        return dataclasses.replace(
            self, profiles=tuple(table.aliased(alias, device) for table in self.profiles),
            **fits)

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
        emulated = emulated_on_gpu(work, keys, device)
        if emulated.any():
            times = np.where(emulated, emulated_times_us(
                work, keys, device, batch_size=batch_size, phase=phase, roofline=roofline,
                cast_times_us=self.cast_times_us), times)
        floor_source = "floor:" + roofline.source.removeprefix("fit:")
        floored = roofline.floored(flops, nbytes, work.kinds, device, precisions) & ~emulated
        sources = [floor_source if f else roofline.source for f in floored]
        busy = np.flatnonzero((flops > 0) | (nbytes > 0))
        for i, (us, source) in measured_op_times(self.profiles, work, device.name, keys,
                                                 phase=phase, batch_size=batch_size,
                                                 ops=busy).items():
            times[i], sources[i] = us, source
        return times, sources

    def op_host_times_us(self, work: OpWork, device: DeviceSpec, *, batch_size: int, phase: str,
                         plan_precisions: Sequence["Precision | str"]) -> np.ndarray:
        """Per op of ``work``, the host's time to issue ``phase`` on ``device`` (a GPU; the
        device runs it asynchronously), from the first profile with host times there
        (:meth:`~qsync_lab.costs.ProfileTable.op_host_us`: the op's row, else the median of
        its kind, else of its precision and phase); NaN where no profile has one: no host
        term (the CPU's ops are the host's work; profiles written before ``host_us``)."""
        return measured_host_times(self.profiles, work, device.name, plan_precisions,
                                   phase=phase, batch_size=batch_size)

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
        return cast_times_us(numel, src, dst, device, self.cast_fits.get((device.name, src, dst)),
                             self.roofline_for(device))

    def allreduce_time_us(self, nbytes: float, ranks: int, links: Sequence[LinkSpec]) -> Cost:
        """Ring allreduce of ``nbytes`` over ``ranks`` ranks, limited by the slowest link
        (:func:`~qsync_lab.costs.collectives.ring_cost`)."""
        return ring_cost(ring_allreduce_us, nbytes, ranks, links, self.link_fits)

    def allgather_time_us(self, nbytes: float, ranks: int, links: Sequence[LinkSpec]) -> Cost:
        """Ring all-gather of ``nbytes`` from every rank, limited by the slowest link
        (:func:`~qsync_lab.costs.collectives.ring_cost`)."""
        return ring_cost(ring_allgather_us, nbytes, ranks, links, self.link_fits)

    def broadcast_time_us(self, nbytes: float, ranks: int, links: Sequence[LinkSpec]) -> Cost:
        """Broadcast of ``nbytes`` from one rank to the others (DDP's buffers), over the
        slowest of ``links``, measured where the profile has it
        (:func:`~qsync_lab.costs.collectives.broadcast_cost`)."""
        return broadcast_cost(nbytes, ranks, links, self.link_fits)

    def compression_time_us(self, spec: str, step: str, numel: float, bytes_per_element: float,
                            device: DeviceSpec) -> Cost:
        """One gradient compressor's ``step`` ("encode", or "decode" of one rank's payload)
        over ``numel`` elements on ``device``: a fitted line where the profiles measured this
        spec (its cost label, e.g. "global_qsgd:8"), else the roofline of
        ``bytes_per_element`` read and written, plus a launch
        (:func:`~qsync_lab.costs.memory_bound.compression_cost`)."""
        return compression_cost(numel, bytes_per_element, device,
                                self.compress_fits.get((device.name, spec, step)),
                                self.roofline_for(device))

    def compression_in_step_us(self, spec: str, numel: float, device: DeviceSpec) -> Cost:
        """What one compressed group call of ``numel`` elements adds to a real DDP step
        beyond the composed estimate (the profile's ``in_step`` line for ``spec``, fitted on
        calibration steps; may be negative), or 0 where nothing was measured."""
        return in_step_cost(numel, self.compress_fits.get((device.name, spec, "in_step")))

    def optimizer_time_us(self, param_bytes: float, optimizer: str, device: DeviceSpec) -> Cost:
        """One optimizer step over ``param_bytes`` of fp32 parameters, memory-bound
        (:func:`~qsync_lab.costs.memory_bound.optimizer_cost`)."""
        return optimizer_cost(param_bytes, optimizer, device, self.roofline_for(device))
