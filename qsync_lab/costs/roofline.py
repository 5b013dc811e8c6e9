"""Roofline operator times from the device catalog, scaled by per-kind efficiency factors.

``time_us = max(flops / (peak_flops[precision] * compute_efficiency[kind]),
bytes / (memory_bandwidth * memory_efficiency[kind]), floor_us[kind, precision]) +
launch_us`` for an op that does any work, and 0 for one that does none (views). The floor
(none by default) is the least time an op of that kind and precision takes on the device
whatever its work, where a measured profile shows one
(:func:`qsync_lab.costs.calibrate_efficiency`).

The efficiency factors are data: :data:`DEFAULT_EFFICIENCY` holds *initial values*, not
measurements. A catalog entry may carry measured factors of its own (``compute_efficiency``,
``memory_efficiency`` in ``devices.toml``), which :meth:`Roofline.for_device` puts in their
place; :func:`qsync_lab.costs.calibrate_efficiency` fits them per device from a measured
profile, and the resulting :class:`Roofline` records where its numbers came from.

Example::

    >>> import numpy as np
    >>> from qsync_lab.devices import load_catalog
    >>> t4 = load_catalog().device("T4")
    >>> roof = default_roofline()
    >>> us = roof.times_us(np.array([2e9]), np.array([1e6]), ["linear"], t4, ["fp16"])
    >>> round(float(us[0]), 2)   # 2 GFLOP at 65 TFLOP/s x 0.7, plus 5 us launch
    48.96
"""

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import pandas as pd

from qsync_lab.devices import US_PER_SECOND, DeviceSpec
from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision

__all__ = ["DEFAULT_EFFICIENCY", "DEFAULT_LAUNCH_US", "Roofline", "default_roofline"]

#: kind -> (compute efficiency, memory efficiency). Initial values to be calibrated on
#: measured profiles (``calibrate_efficiency``), not measurements: large cuBLAS GEMMs
#: typically reach 60-80% of the datasheet peak, convolutions and small batched matmuls
#: less, streaming element-wise kernels 70-90% of the memory bandwidth. ``"other"`` is
#: used for every kind not listed.
DEFAULT_EFFICIENCY: Mapping[str, tuple[float, float]] = MappingProxyType({
    "linear": (0.7, 0.8),
    "matmul": (0.5, 0.8),
    "conv1d": (0.6, 0.8),
    "conv2d": (0.6, 0.8),
    "conv3d": (0.6, 0.8),
    "conv_transpose": (0.5, 0.8),
    "attention": (0.5, 0.8),
    "contraction": (0.5, 0.8),
    "recurrent": (0.3, 0.8),
    "other": (1.0, 0.8),
})
#: fixed cost per kernel launch (framework dispatch + CUDA launch), µs; an initial value
#: to be calibrated like the efficiencies.
DEFAULT_LAUNCH_US = 5.0
DEFAULT_SOURCE = "roofline"


@dataclass(frozen=True)
class Roofline:
    """Efficiency factors and launch overhead of one device (or the default for all).

    Attributes:
        compute_efficiency: kind -> fraction of the peak FLOP/s reached (``"other"`` is
            the fallback for unlisted kinds).
        memory_efficiency: kind -> fraction of the memory bandwidth reached.
        launch_us: fixed cost per kernel.
        floor_us: (kind, precision name) -> least time of such an op beyond ``launch_us``
            (fitted; pairs not listed have none).
        source: where the factors come from (``"roofline"`` for the initial values,
            ``"fit:<profile>"`` after calibration); op costs carry it.
    """

    compute_efficiency: Mapping[str, float] = field(hash=False)
    memory_efficiency: Mapping[str, float] = field(hash=False)
    launch_us: float = DEFAULT_LAUNCH_US
    source: str = DEFAULT_SOURCE
    floor_us: Mapping[tuple[str, str], float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name, table in (("compute", self.compute_efficiency),
                            ("memory", self.memory_efficiency)):
            if "other" not in table:
                raise QSyncError(f"the {name} efficiency table needs an 'other' entry "
                                 "(the fallback for unlisted kinds)")
            bad = [k for k, v in table.items() if not v > 0]
            if bad:
                raise QSyncError(f"{name} efficiency of {bad[0]!r} must be positive, "
                                 f"got {table[bad[0]]}")
        if self.launch_us < 0:
            raise QSyncError(f"launch_us must be >= 0, got {self.launch_us}")
        bad = [k for k, v in self.floor_us.items() if not v >= 0]
        if bad:
            raise QSyncError(f"floor_us of {bad[0]} must be >= 0, got {self.floor_us[bad[0]]}")

    def efficiency(self, kinds: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(compute, memory) efficiency per kind."""
        compute, memory = self.compute_efficiency, self.memory_efficiency
        return (np.array([compute.get(k, compute["other"]) for k in kinds], float),
                np.array([memory.get(k, memory["other"]) for k in kinds], float))

    def times_us(self, flops: np.ndarray, nbytes: np.ndarray, kinds: Sequence[str],
                 device: DeviceSpec, precisions: Sequence["Precision | str"]) -> np.ndarray:
        """Roofline time per op (0 for ops with no FLOPs and no bytes).

        Raises:
            QSyncError: if ``device`` does not run one of ``precisions``.
        """
        work_us, floor_us = self._work_us(flops, nbytes, kinds, device, precisions)
        busy = (flops > 0) | (nbytes > 0)
        return np.where(busy, np.maximum(work_us, floor_us) + self.launch_us, 0.0)

    def traffic_us(self, nbytes: np.ndarray, kind: str, device: DeviceSpec) -> np.ndarray:
        """Roofline time of kernels of ``kind`` that only move ``nbytes`` each (casts,
        compressors, optimizer steps): the bytes at the memory bandwidth, plus a launch.

        Example::

            >>> from qsync_lab.devices import load_catalog
            >>> t4 = load_catalog().device("T4")   # 192 MB at 320 GB/s x 0.8, plus 5 us
            >>> default_roofline().traffic_us(np.array([192e6]), "cast", t4).tolist()
            [755.0]
        """
        return self.times_us(np.zeros(len(nbytes)), nbytes, [kind] * len(nbytes), device,
                             [Precision.FP32] * len(nbytes))

    def floored(self, flops: np.ndarray, nbytes: np.ndarray, kinds: Sequence[str],
                device: DeviceSpec, precisions: Sequence["Precision | str"]) -> np.ndarray:
        """Per op, whether its floor (a measured least time, ``floor_us``) and not its
        work sets its roofline time."""
        work_us, floor_us = self._work_us(flops, nbytes, kinds, device, precisions)
        return floor_us > work_us

    def _work_us(self, flops, nbytes, kinds, device, precisions) -> tuple[np.ndarray, np.ndarray]:
        """Per op, the time its work takes at the efficiencies, and its floor (0: none)."""
        peak = _peaks(device, precisions)
        compute_eff, memory_eff = self.efficiency(kinds)
        compute_s = flops / (peak * compute_eff)
        memory_s = nbytes / (device.memory_bandwidth_Bps * memory_eff)
        floor_us = np.zeros(len(kinds))
        if self.floor_us:
            names = {p: str(Precision.parse(p)) for p in set(precisions)}
            floor_us = np.array([self.floor_us.get((k, names[p]), 0.0)
                                 for k, p in zip(kinds, precisions)], float)
        return np.maximum(compute_s, memory_s) * US_PER_SECOND, floor_us

    def for_device(self, device: DeviceSpec) -> "Roofline":
        """This roofline with ``device``'s catalog efficiencies in place of its factors
        (itself when the catalog has none for the device).

        Example::

            >>> from qsync_lab.devices import load_catalog
            >>> h200 = load_catalog().device("H200-SXM-141GB")
            >>> roof = default_roofline().for_device(h200)
            >>> roof.efficiency(["linear", "conv2d"])[0].tolist(), roof.memory_efficiency["other"]
            ([0.796, 0.6], 0.896)
        """
        if not device.compute_efficiency and device.memory_efficiency is None:
            return self
        memory = (self.memory_efficiency if device.memory_efficiency is None
                  else dict.fromkeys(self.memory_efficiency, device.memory_efficiency))
        return dataclasses.replace(
            self, compute_efficiency=MappingProxyType({**self.compute_efficiency,
                                                       **device.compute_efficiency}),
            memory_efficiency=MappingProxyType(memory))

    def to_frame(self) -> pd.DataFrame:
        """One row per kind: ``compute_efficiency, memory_efficiency``.

        Example::

            >>> default_roofline().to_frame().loc["linear"].tolist()
            [0.7, 0.8]
        """
        kinds = list(dict.fromkeys([*self.compute_efficiency, *self.memory_efficiency]))
        compute, memory = self.efficiency(kinds)
        return pd.DataFrame({"compute_efficiency": compute, "memory_efficiency": memory},
                            index=pd.Index(kinds, name="kind"))


def default_roofline() -> Roofline:
    """The roofline with :data:`DEFAULT_EFFICIENCY` and :data:`DEFAULT_LAUNCH_US`."""
    return Roofline(
        compute_efficiency=MappingProxyType({k: c for k, (c, _) in DEFAULT_EFFICIENCY.items()}),
        memory_efficiency=MappingProxyType({k: m for k, (_, m) in DEFAULT_EFFICIENCY.items()}),
    )


def _peaks(device: DeviceSpec, precisions: Sequence["Precision | str"]) -> np.ndarray:
    distinct = {p: device.peak_flops_for(p) for p in set(precisions)}
    return np.array([distinct[p] for p in precisions], float)
