"""Fit the cost model's free parameters to measured times.

* :func:`calibrate_efficiency` fits the roofline's compute and memory efficiency per op
  kind on one device, by least squares on the rows of a measured profile.
* :func:`fit_cast_costs` fits ``time_us = a * numel + b`` per (device, src, dst) cast.

Both take the rows of a :class:`~qsync_lab.costs.ProfileTable` (or any frame with the
same columns), so the profiler of part 2 feeds them directly; nothing is pasted by hand.

Example::

    >>> import numpy as np, pandas as pd
    >>> from qsync_lab.devices import load_catalog
    >>> t4 = load_catalog().device("T4")
    >>> flops = np.array([1e9, 2e9, 4e9])          # compute-bound linears at 50% of peak
    >>> time_us = flops / (65e12 * 0.5) * 1e6 + 5.0
    >>> rows = pd.DataFrame({"device": "T4", "kind": "linear", "precision": "fp16",
    ...     "phase": "forward", "flops": flops, "bytes": 1e3, "time_us": time_us})
    >>> roof = calibrate_efficiency(rows, t4, source="profile:T4.csv")
    >>> round(roof.compute_efficiency["linear"], 3), roof.source
    (0.5, 'fit:profile:T4.csv')
"""

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import pandas as pd

from qsync_lab.devices import US_PER_SECOND, DeviceSpec
from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision
from qsync_lab.costs.profiles import OP_PHASES
from qsync_lab.costs.roofline import Roofline, default_roofline

__all__ = ["CastFit", "calibrate_efficiency", "fit_cast_costs", "fit_compression_costs"]

_MAX_ROUNDS = 50


@dataclass(frozen=True)
class CastFit:
    """``time_us = a_us_per_element * numel + b_us``: one cast (device, src, dst), or one
    compressor's encode or decode.

    Attributes:
        a_us_per_element: slope.
        b_us: intercept (launch and fixed costs).
        samples: rows the fit used.
        source: ``"fit:<profile>"``.
    """

    a_us_per_element: float
    b_us: float
    samples: int
    source: str

    def time_us(self, numel: "float | np.ndarray") -> "float | np.ndarray":
        """The fitted time for ``numel`` elements (never negative)."""
        return np.maximum(self.a_us_per_element * numel + self.b_us, 0.0)


def calibrate_efficiency(measured: pd.DataFrame, device: DeviceSpec, *,
                         base: Roofline | None = None, source: str = "measured") -> Roofline:
    """Fit per-kind efficiencies of ``device`` to its measured op times.

    For each kind with rows on ``device`` (cast rows are ignored), with ``a = flops/peak``
    and ``b = bytes/bandwidth`` per row and the launch overhead of ``base`` subtracted,
    the model ``t = max(a / e_compute, b / e_memory)`` is fitted by least squares: rows
    are split into compute- and memory-bound under the current factors, each factor is
    the least-squares solution on its rows, and the split is repeated until it is stable.
    Kinds without rows keep ``base``'s factors.

    Args:
        measured: rows with columns ``device, kind, precision, phase, flops, bytes,
            time_us`` (a profile's ``frame``).
        device: the device the rows were measured on (rows of other devices are skipped).
        base: the starting roofline (default :func:`default_roofline` with ``device``'s
            catalog efficiencies).
        source: where the rows come from; the result's source is ``"fit:<source>"``.

    Returns:
        A new :class:`Roofline` for ``device``.
    """
    base = base if base is not None else default_roofline().for_device(device)
    rows = measured[(measured["device"] == device.name) & measured["phase"].isin(OP_PHASES)]
    if rows.empty:
        raise QSyncError(f"no measured op rows for device {device.name!r} in {source}; "
                         "profile that device first")
    compute = dict(base.compute_efficiency)
    memory = dict(base.memory_efficiency)
    for kind, group in rows.groupby("kind", sort=True):
        peak = np.array([device.peak_flops_for(Precision.parse(p)) for p in group["precision"]])
        a = group["flops"].to_numpy(float) / peak * US_PER_SECOND
        b = group["bytes"].to_numpy(float) / device.memory_bandwidth_Bps * US_PER_SECOND
        t = np.maximum(group["time_us"].to_numpy(float) - base.launch_us, 0.0)
        start = base.efficiency([kind])
        inv_compute, inv_memory = _fit_max_model(a, b, t, 1 / start[0][0], 1 / start[1][0])
        compute[kind], memory[kind] = 1 / inv_compute, 1 / inv_memory
    return Roofline(MappingProxyType(compute), MappingProxyType(memory), base.launch_us,
                    f"fit:{source}")


def _fit_max_model(a: np.ndarray, b: np.ndarray, t: np.ndarray, x: float,
                   y: float) -> tuple[float, float]:
    """Least squares for ``t ≈ max(a·x, b·y)`` by alternating the bound assignment."""
    bound = None
    for _ in range(_MAX_ROUNDS):
        compute_bound = a * x >= b * y
        if bound is not None and np.array_equal(bound, compute_bound):
            break
        bound = compute_bound
        x = _slope(a[compute_bound], t[compute_bound], x)
        y = _slope(b[~compute_bound], t[~compute_bound], y)
    return x, y


def _slope(x: np.ndarray, t: np.ndarray, default: float) -> float:
    """Least-squares ``s`` in ``t ≈ s·x`` (``default`` without usable rows)."""
    denominator = float(x @ x)
    slope = float(x @ t) / denominator if denominator > 0 else 0.0
    return slope if slope > 0 else default


def fit_cast_costs(measured: pd.DataFrame, *, source: str = "measured"
                   ) -> Mapping[tuple[str, Precision, Precision], CastFit]:
    """Fit ``time_us = a·numel + b`` per (device, src, dst) from cast rows.

    Args:
        measured: rows with ``device, phase, precision ("src->dst"), numel, time_us``.
        source: where the rows come from; each fit's source is ``"fit:<source>"``.

    Returns:
        (device, src, dst) -> :class:`CastFit`; one row gives a line through the origin.

    Example::

        >>> import pandas as pd
        >>> rows = pd.DataFrame({"device": "T4", "phase": "cast", "precision": "fp32->fp16",
        ...                      "numel": [1e6, 2e6], "time_us": [12.0, 22.0]})
        >>> fit = fit_cast_costs(rows)[("T4", Precision.FP32, Precision.FP16)]
        >>> round(fit.a_us_per_element * 1e6, 6), round(fit.b_us, 6)
        (10.0, 2.0)
    """
    casts = measured[measured["phase"] == "cast"]
    fits: dict[tuple[str, Precision, Precision], CastFit] = {}
    for (device, pair), group in casts.groupby(["device", "precision"], sort=True):
        src, _, dst = pair.partition("->")
        fits[(device, Precision.parse(src), Precision.parse(dst))] = _line(group, source)
    return MappingProxyType(fits)


def fit_compression_costs(measured: pd.DataFrame, *, source: str = "measured"
                          ) -> Mapping[tuple[str, str, str], CastFit]:
    """Fit ``time_us = a·numel + b`` per (device, compression spec, "encode"/"decode") from
    the profile's ``compress`` rows (``op`` the spec, ``kind`` the step).

    Example::

        >>> import pandas as pd
        >>> rows = pd.DataFrame({"device": "cpu", "phase": "compress", "op": "cgx:4",
        ...                      "kind": "encode", "numel": [1e6, 2e6], "time_us": [110.0, 210.0]})
        >>> fit = fit_compression_costs(rows)[("cpu", "cgx:4", "encode")]
        >>> round(float(fit.time_us(4e6)), 6)
        410.0
    """
    rows = measured[measured["phase"] == "compress"]
    return MappingProxyType({key: _line(group, source) for key, group in
                             rows.groupby(["device", "op", "kind"], sort=True)})


def _line(group: pd.DataFrame, source: str) -> CastFit:
    """The least-squares line of ``time_us`` over ``numel`` (through the origin from one
    size)."""
    numel = group["numel"].to_numpy(float)
    t = group["time_us"].to_numpy(float)
    if len(np.unique(numel)) >= 2:
        a, b = np.polyfit(numel, t, 1)
    elif numel.mean() > 0:
        a, b = float(t.mean() / numel.mean()), 0.0
    else:
        a, b = 0.0, float(t.mean())
    return CastFit(float(a), float(b), len(group), f"fit:{source}")
