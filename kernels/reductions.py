"""Reductions: abs-max (exact, on the float bits) and the float64-accumulated L2 norm.

The quantizers take their scale (APS: its exponent) from one of these, and reject NaN/Inf
found by that same pass (``_finite_absmax`` for the abs-max).
"""

import math

import torch

from . import reference as ref
from .plumbing import (
    _arr,
    _backend,
    _check_float,
    _f32,
    _from_numpy,
    _geometry,
    _kernels,
    _nan_error,
)

_ABS_MASK = {torch.float32: 0x7FFFFFFF, torch.float16: 0x7FFF, torch.bfloat16: 0x7FFF}
_BITS_DTYPE = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _bits_to_float(bits, dtype):
    """Convert abs-max bit patterns (int64) of ``dtype`` to float32 values."""
    if dtype == torch.float32:
        return bits.to(torch.int32).view(torch.float32)
    if dtype == torch.bfloat16:
        return (bits.to(torch.int32) << 16).view(torch.float32)
    return bits.to(torch.int16).view(torch.float16).to(torch.float32)


def absmax(x, axis=None, *, backend="auto"):
    """Return max |x| over the tensor (``axis=None``) or per channel along ``axis``.

    Reads the float bit patterns (fp32/fp16/bf16, no upcast) and is exact. NaN propagates
    like ``torch.amax``: a channel holding a NaN gives NaN; an empty channel gives 0.

    Args:
        x: float32/float16/bfloat16 tensor, any layout.
        axis: None for one value, or the channel dimension (negative allowed).
        backend: "auto", "cpu", "cuda" or "reference".

    Returns:
        float32 tensor on x's device: 0-dim, or shape ``[x.shape[axis]]``.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import absmax
        >>> absmax(torch.tensor([[1.0, -3.0], [2.0, 0.5]]), axis=0).tolist()
        [3.0, 2.0]
    """
    _check_float(x)
    be = _backend(x, backend)
    axis, inner, nch = _geometry(x, axis)
    if be == "reference":
        out = ref.absmax(x.detach().cpu().float().numpy(), axis)
        return _from_numpy(out, x.device).reshape(() if axis is None else (-1,))
    xc = x.detach().contiguous()
    bits = torch.zeros(nch, dtype=torch.int64, device=x.device)
    if xc.numel():
        xb = _arr(xc.view(_BITS_DTYPE[x.dtype]))
        _kernels(be).absmax_bits(xb, _ABS_MASK[x.dtype], inner, nch, _arr(bits))
    out = _bits_to_float(bits, x.dtype)
    if axis is None:
        return out.reshape(())
    return out[: x.shape[axis]]


def _finite_absmax(x, axis, backend, what="x"):
    amax = absmax(x, axis, backend=backend)
    if amax.numel() and not math.isfinite(float(amax.max())):  # NaN propagates through max
        raise _nan_error(what)
    return amax


def l2norm(x, *, backend="auto"):
    """Euclidean norm of x, accumulated in float64 (returned as a Python float)."""
    _check_float(x)
    be = _backend(x, backend)
    if be == "reference":
        return ref.l2norm(x.detach().cpu().float().numpy())
    acc = torch.zeros(1, dtype=torch.float64, device=x.device)
    if x.numel():
        _kernels(be).sum_squares(_arr(_f32(x.detach())), _arr(acc))
    return math.sqrt(float(acc.item()))
