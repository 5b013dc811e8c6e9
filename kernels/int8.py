"""Symmetric int8: quantize, dequantize and fake-quantize (per tensor or per channel)."""

import math
from typing import NamedTuple

import torch

from qsync_lab.errors import QSyncError

from . import floatfmt
from . import reference as ref
from .floats import _TORCH_FORMATS, _format_tuple, _round
from .plumbing import (
    _arr,
    _backend,
    _check_float,
    _check_rounding,
    _check_seed,
    _empty,
    _f32,
    _from_numpy,
    _geometry,
    _into,
    _kernels,
    _nan_error,
    _out,
    _rows_in_place,
    exact_div_,
)
from .reductions import _finite_absmax
from .rng import rng_key

_OUT_FORMAT = {torch.float32: floatfmt.FP32, **_TORCH_FORMATS}


class Int8Tensor(NamedTuple):
    """int8 codes with their float32 scale (0-dim, or one per channel along ``axis``)."""

    codes: torch.Tensor
    scale: torch.Tensor
    axis: int | None


class FakeQuantResult(NamedTuple):
    """Output of ``fake_quantize_int8`` with the error statistics the indicator needs."""

    output: torch.Tensor
    sse: float
    numel: int
    scale: torch.Tensor


def _channel_scales(scale, x, axis, nch):
    """Validate a caller's scale and return it as a contiguous float32 [nch] tensor."""
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(scale, dtype=torch.float32)
    want = () if axis is None else (x.shape[axis],)
    if tuple(scale.shape) != want and not (axis is None and tuple(scale.shape) == (1,)):
        raise QSyncError(
            f"scale has shape {tuple(scale.shape)}; expected {want} for axis={axis}"
        )
    scale = scale.detach().to(device=x.device, dtype=torch.float32).reshape(-1).contiguous()
    if not scale.numel():
        return torch.ones(nch, device=x.device)
    lo, hi = torch.aminmax(scale)  # NaN propagates to both
    if not (float(lo) >= 0 and float(hi) < math.inf):
        raise QSyncError("scale must be finite and >= 0; pass amax / 127 per tensor or channel")
    return scale


def _quantize(x, axis, scale, qmax, stochastic, seed, be, out=None, check=False):
    """int8 codes of x (float tensor) with a [nch] scale; the shared core of int8/QSGD.

    ``check``: also raise for NaN/Inf in x (the CPU kernel finds them in the same pass; other
    backends run the abs-max pass first).
    """
    axis, inner, nch = _geometry(x, axis)
    codes = _out(out, x.shape, torch.int8, x.device)
    if check and be != "cpu":
        _finite_absmax(x, axis, be)
    if be == "reference":
        res = ref.quantize(
            x.detach().cpu().float().numpy(),
            scale.cpu().numpy() if axis is not None else scale.cpu().numpy()[0],
            axis,
            qmax,
            stochastic,
            seed,
        )
        return _into(_from_numpy(res, x.device), out)
    xf = _f32(x.detach())
    if x.numel():
        top = _kernels(be).quantize(
            _arr(xf), _arr(scale), inner, nch, qmax, stochastic, rng_key(seed), _arr(codes)
        )
        if check and be == "cpu" and top >= 0x7F800000:
            raise _nan_error()
    return codes


def quantize_int8(x, *, axis=None, scale=None, rounding="nearest", seed=0, backend="auto",
                  out=None):
    """Quantize to symmetric int8 (zero-point 0, codes in [-127, 127]).

    ``scale = absmax / 127`` (per tensor or per channel) unless given. ``rounding="nearest"``
    rounds half to even (``torch.round``); ``"stochastic"`` rounds ``x/scale`` up with
    probability equal to its fractional part, from a counter RNG keyed by (seed, index).
    A zero scale (all-zero input) gives all-zero codes.

    Args:
        x: float32/float16/bfloat16 tensor; NaN or Inf raises QSyncError.
        axis: None (per tensor) or the channel dimension.
        scale: optional float32 scale (0-dim, or one per channel).
        rounding: "nearest" or "stochastic".
        seed: stream for stochastic rounding, 0 <= seed < 2**63.
        backend: "auto", "cpu", "cuda" or "reference".
        out: optional contiguous int8 tensor of x's shape and device for the codes (with a
            given scale, x is read once: NaN/Inf are found in the same pass, and then ``out``
            holds garbage).

    Returns:
        Int8Tensor(codes, scale, axis).

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import quantize_int8
        >>> q = quantize_int8(torch.tensor([0.5, -1.27, 0.0]))
        >>> q.codes.tolist(), round(q.scale.item(), 6)
        ([50, -127, 0], 0.01)
    """
    _check_float(x)
    stochastic = _check_rounding(rounding)
    _check_seed(seed)
    be = _backend(x, backend)
    axis, inner, nch = _geometry(x, axis)
    if scale is None:
        amax = _finite_absmax(x, axis, be)
        scale = exact_div_(amax, 127).reshape(-1).contiguous()
        check = False
    else:
        scale = _channel_scales(scale, x, axis, nch)
        check = True
    codes = _quantize(x, axis, scale, 127, stochastic, seed, be, out, check)
    return Int8Tensor(codes, scale.reshape(() if axis is None else (-1,)), axis)


def _dequantize(codes, scale, axis, spec, be, out=None):
    axis_, inner, nch = _geometry(codes, axis)
    if be == "reference":
        s = scale.cpu().numpy()
        res = ref.dequantize(codes.cpu().numpy(), s if axis_ is not None else s[0], axis_)
        if spec is not None:
            res = ref.round_to_format(res, spec)
        return _into(_from_numpy(res, codes.device), out)
    out = _out(out, codes.shape, torch.float32, codes.device)
    if codes.numel():
        k, q = _kernels(be), _arr(codes.contiguous())
        if be == "cpu":  # rounded in the same pass
            bits = _arr(out.view(torch.int32)).view("uint32")
            k.dequantize(q, _arr(scale), inner, nch, bits, spec)
            return out
        k.dequantize(q, _arr(scale), inner, nch, _arr(out))
        if spec is not None:
            _round(out, spec, 1.0, 1.0, be, out)
    return out


def dequantize_int8(codes, scale, *, axis=None, fmt=None, dtype=torch.float32, backend="auto",
                    out=None):
    """Return ``codes * scale`` (computed in float32, rounded to ``fmt`` when given, then cast
    to ``dtype``).

    ``fmt``: a float format as in ``float_round`` (the values stay float32, bit-exact with
    ``float_round(codes * scale, fmt)``); on the CPU the rounding costs no extra pass.
    ``out``: optional contiguous tensor of ``dtype`` and the codes' shape and device.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import dequantize_int8, quantize_int8
        >>> q = quantize_int8(torch.tensor([0.5, -1.27]))
        >>> dequantize_int8(q.codes, q.scale).tolist()
        [0.5, -1.2699999809265137]
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.int8:
        raise QSyncError("codes must be an int8 torch.Tensor (from quantize_int8)")
    be = _backend(codes, backend)
    axis_, _, nch = _geometry(codes, axis)
    scale = _channel_scales(scale, codes, axis_, nch)
    spec = None if fmt is None else _format_tuple(fmt)
    if out is None:
        return _dequantize(codes, scale, axis_, spec, be).to(dtype)
    _out(out, codes.shape, dtype, codes.device)
    if dtype == torch.float32:
        return _dequantize(codes, scale, axis_, spec, be, out)
    return _into(_dequantize(codes, scale, axis_, spec, be).to(dtype), out)


def dequantize_int8_sum(codes, scales, *, divisor=1, backend="auto", out=None):
    """The sum over ``codes``' first axis of each row times its own scale, over ``divisor``:
    ``(((0 + q_0·s_0) + q_1·s_1) + ...) / divisor`` in float32, each product rounded as
    :func:`dequantize_int8` rounds it. Bit for bit what adding each row's dequantized values
    to zeros and dividing the sum gives; on the CPU in one pass over the sum (each block of
    it stays in cache while every row is added). For the ranks' payloads of an all-gather.

    The rows are read in place wherever they lie along the first axis's stride, as long as
    each is contiguous (e.g. the codes behind each rank's header in gathered payloads).
    (On a GPU the compiler may fuse a product with its sum, which rounds once instead of
    twice.)

    Args:
        codes: int8 tensor of at least one dimension, its rows along the first.
        scales: one scale per row (a sequence or a 1-D tensor), finite and >= 0.
        divisor: a positive number the sum is divided by (the world size for a mean).
        backend: "auto", "cpu", "cuda" or "reference".
        out: optional contiguous float32 tensor of shape ``codes.shape[1:]`` on the codes'
            device; overwritten.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import dequantize_int8_sum
        >>> codes = torch.tensor([[2, -4], [1, 3]], dtype=torch.int8)
        >>> dequantize_int8_sum(codes, [0.5, 2.0], divisor=2).tolist()
        [1.5, 2.0]
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.int8 or codes.dim() < 1:
        raise QSyncError("codes must be an int8 torch.Tensor of at least one dimension (its "
                         "rows along the first)")
    rows, shape = codes.shape[0], tuple(codes.shape[1:])
    scales = torch.as_tensor(scales, dtype=torch.float32).detach().reshape(-1).cpu()
    if scales.numel() != rows:
        raise QSyncError(f"scales has {scales.numel()} values for {rows} rows of codes; "
                         "pass one scale per row")
    if rows and not bool(torch.isfinite(scales).all() and (scales >= 0).all()):
        raise QSyncError("scales must be finite and >= 0")
    if isinstance(divisor, bool) or not isinstance(divisor, (int, float)) \
            or not 0 < divisor < math.inf:
        raise QSyncError(f"divisor must be a positive finite number, got {divisor!r}")
    be = _backend(codes, backend)
    if be == "reference":
        res = ref.dequantize_sum(codes.detach().cpu().numpy().reshape(rows, math.prod(shape)),
                                 scales.numpy(), divisor)
        return _into(_from_numpy(res, codes.device).reshape(shape),
                     None if out is None else _out(out, shape, torch.float32, codes.device))
    out = _out(out, shape, torch.float32, codes.device)
    if rows == 0:
        return out.zero_()
    if out.numel():
        flat, stride = _rows_in_place(codes.detach())
        _kernels(be).dequantize_sum(_arr(flat), stride, _arr(scales.to(codes.device)),
                                    float(divisor), _arr(out.view(-1)))
    return out


def fake_quantize_int8(x, *, axis=None, rounding="nearest", seed=0, backend="auto", out=None):
    """Quantize to int8 and back in one pass; also return the error statistics.

    ``out``: optional contiguous tensor of x's shape, dtype and device for the output.

    The output has x's dtype: the float32 value ``q * scale`` rounded once (RNE) to it.
    ``sse`` is the float64 sum of (output - x)² (summation order differs by backend, so it
    agrees to ~1e-12 relative, not bit for bit); ``numel`` the element count.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import fake_quantize_int8
        >>> r = fake_quantize_int8(torch.tensor([1.0, 0.003, -0.5]))
        >>> r.output.tolist()[1], r.numel
        (0.0, 3)
    """
    _check_float(x)
    stochastic = _check_rounding(rounding)
    _check_seed(seed)
    be = _backend(x, backend)
    axis, inner, nch = _geometry(x, axis)
    amax = _finite_absmax(x, axis, be)
    scale = exact_div_(amax, 127).reshape(-1).contiguous()
    out_scale = scale.reshape(() if axis is None else (-1,))
    fmt = _OUT_FORMAT[x.dtype]
    if out is not None:
        _out(out, x.shape, x.dtype, x.device)
    if be == "reference":
        s = scale.cpu().numpy()
        y, sse = ref.fake_quantize(
            x.detach().cpu().float().numpy(), s if axis is not None else s[0],
            axis, stochastic, seed, fmt,
        )
        res = _into(_from_numpy(y, x.device).to(x.dtype), out)
        return FakeQuantResult(res, sse, x.numel(), out_scale)
    xf = _f32(x.detach())
    user_out = out
    if out is None or x.dtype != torch.float32:
        out = _empty(x.shape, torch.float32, x.device)
    acc = torch.zeros(1, dtype=torch.float64, device=x.device)
    if x.numel():
        _kernels(be).fake_quantize(
            _arr(xf), _arr(scale), inner, nch, stochastic, rng_key(seed), fmt, _arr(out),
            _arr(acc),
        )
    res = out.to(x.dtype) if user_out is None else _into(out, user_out)
    return FakeQuantResult(res, float(acc.item()), x.numel(), out_scale)
