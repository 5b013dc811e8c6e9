"""Fit the cost model's free parameters to measured times.

* :func:`calibrate_efficiency` fits the roofline's compute and memory efficiency per op
  kind on one device, by least squares on the rows of a measured profile, and the least
  time per (kind, precision) where the rows show one.
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
#: the floored model replaces the plain one where it divides the squared error by this
FLOOR_GAIN = 2.0
_EXACT = 1e-12  # squared error per squared time below which a fit is exact (rounding)


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

    Rows whose time does not follow their work carry no evidence about the efficiencies:
    ops bound by a fixed cost (a GPU op whose host issues it slower than the device runs
    it: its in-step time is the host's, whatever its size). Fitted anyway, they drive the
    factors towards zero, and the roofline of a large op the profile did not measure
    grows with its work a hundredfold. So the model with a floor per (kind, precision),
    ``t = max(a / e_compute, b / e_memory, floor)``, is fitted too (the floors start at
    each precision's median row, then are the mean of their floor-bound rows); it
    replaces the plain fit where it at least halves the squared error
    (:data:`FLOOR_GAIN`): the factors then come from the rows the work explains (the
    base's where none), and an unmeasured op costs at least its floor.

    Args:
        measured: rows with columns ``device, kind, precision, phase, flops, bytes,
            time_us`` (a profile's ``frame``).
        device: the device the rows were measured on (rows of other devices are skipped).
        base: the starting roofline (default :func:`default_roofline` with ``device``'s
            catalog efficiencies).
        source: where the rows come from; the result's source is ``"fit:<source>"``.

    Returns:
        A new :class:`Roofline` for ``device``.

    Example::

        >>> from qsync_lab.devices import load_catalog
        >>> h200 = load_catalog().device("H200-SXM-141GB")
        >>> nbytes = np.array([1e6, 1e7, 1e8, 1e9, 1e10])  # 40 us fixed cost, then bandwidth
        >>> rows = pd.DataFrame({"device": h200.name, "kind": "add", "precision": "bf16",
        ...     "phase": "forward", "flops": 0.0, "bytes": nbytes,
        ...     "time_us": np.maximum(nbytes / 4.8e12 * 1e6, 40.0) + 5.0})
        >>> roof = calibrate_efficiency(rows, h200)
        >>> round(roof.memory_efficiency["add"], 3), roof.floor_us[("add", "bf16")]
        (1.0, 40.0)
    """
    base = base if base is not None else default_roofline().for_device(device)
    rows = measured[(measured["device"] == device.name) & measured["phase"].isin(OP_PHASES)]
    if rows.empty:
        raise QSyncError(f"no measured op rows for device {device.name!r} in {source}; "
                         "profile that device first")
    compute = dict(base.compute_efficiency)
    memory = dict(base.memory_efficiency)
    floors = dict(base.floor_us)
    for kind, group in rows.groupby("kind", sort=True):
        peak = np.array([device.peak_flops_for(Precision.parse(p)) for p in group["precision"]])
        a = group["flops"].to_numpy(float) / peak * US_PER_SECOND
        b = group["bytes"].to_numpy(float) / device.memory_bandwidth_Bps * US_PER_SECOND
        t = np.maximum(group["time_us"].to_numpy(float) - base.launch_us, 0.0)
        start = base.efficiency([kind])
        x, y = _fit_max_model(a, b, t, 1 / start[0][0], 1 / start[1][0])
        labels = np.array([str(p).lower() for p in group["precision"]])
        fx, fy, floor = _fit_floored_model(a, b, t, labels, 1 / start[0][0], 1 / start[1][0])
        row_floor = np.array([floor[p] for p in labels])
        floored_error = _squared_error(t, np.maximum(np.maximum(a * fx, b * fy), row_floor))
        plain_error = _squared_error(t, np.maximum(a * x, b * y))
        if plain_error > FLOOR_GAIN * floored_error + _EXACT * float(t @ t):
            x, y = fx, fy
            floors.update({(kind, p): f for p, f in floor.items() if f > 0})
        compute[kind], memory[kind] = 1 / x, 1 / y
    return Roofline(MappingProxyType(compute), MappingProxyType(memory), base.launch_us,
                    f"fit:{source}", MappingProxyType(floors))


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


def _fit_floored_model(a: np.ndarray, b: np.ndarray, t: np.ndarray, labels: np.ndarray,
                       x: float, y: float) -> tuple[float, float, dict[str, float]]:
    """Least squares for ``t ≈ max(a·x, b·y, floor[label])`` by alternating the bound
    assignment, each floor starting at its label's median (0: no row is floor-bound)."""
    floor = {p: float(np.median(t[labels == p])) for p in np.unique(labels)}
    bound = None
    for _ in range(_MAX_ROUNDS):
        floored = np.array([floor[p] for p in labels]) > np.maximum(a * x, b * y)
        compute_bound = ~floored & (a * x >= b * y)
        state = np.stack([floored, compute_bound])
        if bound is not None and np.array_equal(bound, state):
            break
        bound = state
        x = _slope(a[compute_bound], t[compute_bound], x)
        memory_bound = ~floored & ~compute_bound
        y = _slope(b[memory_bound], t[memory_bound], y)
        floor = {p: float(t[floored & (labels == p)].mean()) if (floored & (labels == p)).any()
                 else 0.0 for p in floor}
    return x, y, floor


def _squared_error(t: np.ndarray, model: np.ndarray) -> float:
    return float(((t - model) ** 2).sum())


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
