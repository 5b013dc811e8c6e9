"""Operands as a low-precision kernel reads them: int8 codes, fp16/bf16/fp8 values, scales.

``encode(x, p)`` returns what a kernel in precision ``p`` consumes (and what the op saves
for backward): int8 codes with their scale (``qsync_lab.kernels.quantize_int8``), fp16/bf16
values in their torch dtype (RNE casts), fp8 values with a per-tensor dynamic scale, tf32
values (fp32 rounded to 10 mantissa bits). ``decode`` maps it back to float32.

FP8 scaling (the standard FP8 training recipe, as in torchao's Float8Linear): per-tensor
dynamic scale ``s = amax / max_finite(format)`` (1 for an all-zero tensor), stored values
``x / s`` cast to the format (RNE; |x / s| exceeds the largest finite value by at most an
fp32 rounding, which the cast rounds back), dequantized value ``v · s``. Forward operands
use e4m3, gradients e5m2 (:data:`qsync_lab.policy.DEFAULT_BACKWARD`). The scaled cast also
returns the values widened to fp32 (``qsync_lab.kernels.float_quantize``, one pass), which
the emulated product reads; large saved fp8 tensors are widened by
``qsync_lab.kernels.float_decode`` (torch's CPU fp8→fp32 cast is much slower).

Example::

    >>> import torch
    >>> from qsync_lab.precision import Precision
    >>> from qsync_lab.quant.encoding import decode, encode
    >>> e = encode(torch.tensor([0.5, -1.27]), Precision.INT8)
    >>> e.data.tolist(), decode(e).tolist()
    ([50, -127], [0.5, -1.2699999809265137])
    >>> encode(torch.tensor([1/3]), Precision.FP16).data.dtype
    torch.float16
"""

from typing import NamedTuple

import torch

from qsync_lab.kernels import (
    absmax,
    dequantize_int8,
    float_decode,
    float_quantize,
    float_round,
    quantize_int8,
)
from qsync_lab.policy import ROUNDED_OUTPUTS
from qsync_lab.precision import Precision

TF32_FORMAT = (8, 10)
TORCH_DTYPES = {
    Precision.FP16: torch.float16,
    Precision.BF16: torch.bfloat16,
    Precision.FP8_E4M3: torch.float8_e4m3fn,
    Precision.FP8_E5M2: torch.float8_e5m2,
}
FP8_MAX = {p: torch.finfo(TORCH_DTYPES[p]).max for p in (Precision.FP8_E4M3, Precision.FP8_E5M2)}
_FP8_DTYPES = frozenset(TORCH_DTYPES[p] for p in FP8_MAX)
#: elements from which a CPU kernel pass beats torch's casts (a launch has a fixed cost)
ONE_PASS_MIN = 1 << 18


class Encoded(NamedTuple):
    """An operand in a kernel's input format.

    Attributes:
        data: int8 codes, fp16/bf16/fp8 values, or float32 values (fp32, tf32; or fp16/bf16
            values held in float32, for an operand that is not saved).
        scale: float32 dequantization multiplier (0-dim, or one per channel along ``axis``);
            None for unscaled formats.
        axis: the channel dimension of a per-channel scale, else None.
        values: ``data`` widened to float32 (unscaled) when the encoding made it in the same
            pass (fp8), else None.
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    axis: int | None
    values: torch.Tensor | None = None


def channel_view(scale: torch.Tensor, axis: int | None, ndim: int) -> torch.Tensor:
    """Reshape a per-channel scale so it broadcasts along ``axis`` of an ``ndim`` tensor.

    Example::

        >>> import torch
        >>> channel_view(torch.ones(3), -2, 4).shape
        torch.Size([3, 1])
    """
    if axis is None:
        return scale
    return scale.reshape((-1,) + (1,) * (ndim - 1 - axis % ndim))


def round_to(x: torch.Tensor, precision: Precision) -> torch.Tensor:
    """Round to a float format, keeping x's dtype; int8/fp8/fp32 results are left as fp32.

    This is the rounding of an operator's *output* or gradient computed in ``precision``:
    fp16/bf16 kernels write fp16/bf16, while tf32, int8 (dequantized) and fp8 (rescaled)
    kernels write fp32.
    """
    if precision in ROUNDED_OUTPUTS:
        return x.to(TORCH_DTYPES[precision]).to(x.dtype)
    return x


def round_f32(x: torch.Tensor, precision: Precision, *, inplace: bool = False) -> torch.Tensor:
    """``round_to(x.float(), precision)``: float32 values of fp16/bf16 (other precisions: x).

    A large CPU tensor takes one ``float_round`` pass (NaNs keep their bits), in x itself when
    ``inplace`` (a fresh contiguous float32 tensor that nothing else holds); a small one
    takes torch's two casts, cheaper than starting a kernel.
    """
    if precision not in ROUNDED_OUTPUTS:
        return x
    if x.is_cuda or x.numel() < ONE_PASS_MIN:
        return x.to(TORCH_DTYPES[precision]).float()
    out = x if inplace and x.is_contiguous() and x.dtype == torch.float32 else None
    return float_round(x, precision, out=out)


def encode(
    x: torch.Tensor,
    precision: Precision,
    *,
    axis: int | None = None,
    rounding: str = "nearest",
    seed: int = 0,
    amax: torch.Tensor | None = None,
) -> Encoded:
    """Return x in the input format of a ``precision`` kernel (see the module docstring).

    Args:
        x: a float tensor (its autograd history is ignored).
        precision: the kernel's precision.
        axis: channel dimension for per-channel int8 scales (None: per tensor).
        rounding: int8 rounding, "nearest" or "stochastic".
        seed: stochastic-rounding stream (``quantize_int8``'s seed).
        amax: per-tensor abs-max to scale by (int8, fp8) instead of x's own, e.g. the
            whole embedding table's when x holds some of its rows.
    """
    x = x.detach()
    if precision is Precision.INT8:
        scale = None if amax is None else amax / 127
        q = quantize_int8(x, axis=axis, scale=scale, rounding=rounding, seed=seed)
        return Encoded(q.codes, q.scale, q.axis)
    if precision in FP8_MAX:
        fmax = FP8_MAX[precision]
        amax = absmax(x) if amax is None else amax
        scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
        q = float_quantize(x, precision, scale=scale)
        return Encoded(q.codes, scale, None, q.values)
    if precision in TORCH_DTYPES:
        return Encoded(x.to(TORCH_DTYPES[precision]), None, None)
    if precision is Precision.TF32:
        return Encoded(float_round(x, TF32_FORMAT), None, None)
    return Encoded(x.float(), None, None)


def widen(data: torch.Tensor) -> torch.Tensor:
    """Encoded data as float32, unscaled (int8 codes as integers, fp8 values as they are)."""
    if data.dtype in _FP8_DTYPES and not data.is_cuda and data.numel() >= ONE_PASS_MIN:
        return float_decode(data)  # the same bits as torch's cast, much faster
    return data.float()


def widened(enc: Encoded) -> torch.Tensor:
    """``enc.data`` as float32, unscaled: the values the encoding made, else ``widen``."""
    return widen(enc.data) if enc.values is None else enc.values


def decode(enc: Encoded, rounding: Precision | None = None) -> torch.Tensor:
    """Return the float32 values an encoded operand stands for, rounded to fp16/bf16 when
    ``rounding`` names one (int8 codes: by the dequantize kernel, in the same pass)."""
    if enc.data.dtype == torch.int8:
        fmt = rounding if rounding in ROUNDED_OUTPUTS else None
        return dequantize_int8(enc.data, enc.scale, axis=enc.axis, fmt=fmt)
    values = widened(enc)
    if enc.scale is not None:
        values = values * channel_view(enc.scale, enc.axis, values.dim())
    return values if rounding is None else round_f32(values, rounding)


def reencode(enc: Encoded, source: Precision, target: Precision) -> Encoded:
    """Convert an operand encoded in ``source`` to ``target`` (itself when they agree)."""
    if source is target:
        return enc
    return encode(decode(enc), target)
