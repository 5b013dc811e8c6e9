"""How each precision rounds an operand, and the expected energy of that rounding error.

For a tensor ``v`` rounded to a precision, :func:`noise_energy` returns E‖Q(v) − v‖²:

* **int8** (symmetric, per tensor, step ``S = amax/127``): every non-zero element carries a
  rounding error of variance ``c·S²`` — ``c = 1/12`` for round-to-nearest (error uniform on
  [−S/2, S/2]) and ``1/6`` for stochastic rounding (variance p(1−p)·S² averaged over the
  fractional part p). Zeros quantize exactly. (QSync uses 1/6 for both: right only for
  stochastic rounding.)
* **float formats** with ``m`` mantissa bits, rounded to nearest-even: an element in the
  binade [2^E, 2^(E+1)) has step ``ulp = 2^(max(E, E_min) − m)`` (subnormals share the
  smallest step) and error variance ``ulp²/12``. The sum over elements is taken from the
  histogram of the elements' binary exponents. fp8 operands are first scaled per tensor so
  their abs-max lands on the format's largest value (the dynamic-scaling FP8 recipe the
  operators use); fp16/bf16/tf32 are rounded unscaled (values beyond the format's range
  are not modelled).
* **fp32**: no error.

:func:`noise_variance` gives the same expectation per element (its sum is
:func:`noise_energy`), for weighting each element's rounding error by how much it is
amplified downstream (the norm ops' per-channel ``γ/σ``).

Example::

    >>> import math, torch
    >>> v = torch.tensor([1.0, 3.0, 0.0])
    >>> math.isclose(noise_energy(v, "int8"), (3.0 / 127) ** 2 / 12 * 2)
    True
    >>> math.isclose(noise_energy(v, "fp16"), (2.0 ** -10) ** 2 / 12 + (2.0 ** -9) ** 2 / 12)
    True
"""

from dataclasses import dataclass

import torch

from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision

ROUNDING_VARIANCE = {"nearest": 1 / 12, "stochastic": 1 / 6}


@dataclass(frozen=True)
class FloatFormat:
    """An IEEE-like binary format: exponent bits, mantissa bits, optional per-tensor scaling
    to ``scaled_max`` (the format's largest finite value)."""

    exp_bits: int
    man_bits: int
    scaled_max: float | None = None

    @property
    def min_exponent(self) -> int:
        return 2 - 2 ** (self.exp_bits - 1)


FLOAT_FORMATS = {
    Precision.TF32: FloatFormat(8, 10),
    Precision.BF16: FloatFormat(8, 7),
    Precision.FP16: FloatFormat(5, 10),
    Precision.FP8_E4M3: FloatFormat(4, 3, scaled_max=448.0),
    Precision.FP8_E5M2: FloatFormat(5, 2, scaled_max=57344.0),
}


def noise_energy(v: torch.Tensor, precision: "Precision | str",
                 rounding: str = "nearest") -> float:
    """Expected squared rounding error E‖Q(v) − v‖² of rounding ``v`` to ``precision``.

    ``rounding`` applies to int8 only (hardware float formats round to nearest-even).
    """
    p = Precision.parse(precision)
    return operand_noise(v, [p], rounding)[p]


def operand_noise(v: torch.Tensor, precisions, rounding: str = "nearest") -> dict[Precision, float]:
    """:func:`noise_energy` of ``v`` for several precisions, sharing the passes over ``v``:
    one exponent histogram serves every unscaled float format."""
    if rounding not in ROUNDING_VARIANCE:
        raise QSyncError(f"unknown rounding {rounding!r}; choose nearest or stochastic")
    v = v.detach().float()
    wanted = [Precision.parse(p) for p in precisions]
    if v.numel() == 0:
        return dict.fromkeys(wanted, 0.0)
    amax = v.abs().max().item()
    nonzero = int(torch.count_nonzero(v))
    unscaled = None
    out: dict[Precision, float] = {}
    for p in wanted:
        if p is Precision.FP32 or amax == 0:
            out[p] = 0.0
        elif p is Precision.INT8:
            step = amax / 127
            out[p] = ROUNDING_VARIANCE[rounding] * step * step * nonzero
        elif FLOAT_FORMATS[p].scaled_max is None:
            if unscaled is None:
                unscaled = _binade_histogram(v, nonzero)
            out[p] = _ulp_energy(*unscaled, FLOAT_FORMATS[p])
        else:
            scale = amax / FLOAT_FORMATS[p].scaled_max
            out[p] = _ulp_energy(*_binade_histogram(v / scale, nonzero),
                                 FLOAT_FORMATS[p]) * scale * scale
    return out


def noise_variance(v: torch.Tensor, precision: "Precision | str",
                   rounding: str = "nearest") -> torch.Tensor:
    """Per element, the expected squared rounding error of rounding ``v`` to ``precision``
    (fp32 tensor of ``v``'s shape; its sum is :func:`noise_energy`).

    Example::

        >>> v = torch.tensor([1.0, 3.0, 0.0])
        >>> noise_variance(v, "fp16") * 12 * 2.0 ** 20
        tensor([1., 4., 0.])
    """
    if rounding not in ROUNDING_VARIANCE:
        raise QSyncError(f"unknown rounding {rounding!r}; choose nearest or stochastic")
    p = Precision.parse(precision)
    v = v.detach().float()
    amax = v.abs().max().item() if v.numel() else 0.0
    if p is Precision.FP32 or amax == 0:
        return torch.zeros_like(v)
    nonzero = (v != 0).float()
    if p is Precision.INT8:
        step = amax / 127
        return ROUNDING_VARIANCE[rounding] * step * step * nonzero
    fmt = FLOAT_FORMATS[p]
    scale = 1.0 if fmt.scaled_max is None else amax / fmt.scaled_max
    biased = (((v / scale).contiguous().view(torch.int32) >> 23) & 0xFF).float()
    steps = (biased - _FP32_BIAS).clamp(min=fmt.min_exponent) - fmt.man_bits
    return torch.exp2(2 * steps) / 12 * (scale * scale) * nonzero


_FP32_BIAS = 127


def _binade_histogram(v: torch.Tensor, nonzero: int) -> tuple[torch.Tensor, int]:
    """Counts of non-zero elements per binary exponent E (|v| in [2^E, 2^(E+1))), with the
    exponent of the first bin, read from the fp32 exponent field. fp32 subnormals land in
    the first bin (E = -127): below every format's smallest normal, so they round with the
    subnormal step either way."""
    biased = ((v.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    counts = torch.bincount(biased.flatten(), minlength=256)
    counts[0] -= v.numel() - nonzero  # zeros have a zero exponent field and round exactly
    return counts, -_FP32_BIAS


def _ulp_energy(counts: torch.Tensor, first_binade: int, fmt: FloatFormat) -> float:
    """Σ ulp²/12 over the histogram: a binade below the format's smallest normal exponent
    rounds with the subnormal step."""
    binades = torch.arange(counts.numel(), dtype=torch.float64) + first_binade
    steps = binades.clamp(min=fmt.min_exponent) - fmt.man_bits
    return float((counts.double() * torch.exp2(2 * steps)).sum()) / 12
