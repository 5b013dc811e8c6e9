"""Float formats: casts to fp16/bf16/fp8 and back, scaled casts, and rounding in float32."""

import functools
import math
from typing import NamedTuple

import numpy as np
import torch

from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision

from . import floatfmt
from . import reference as ref
from .plumbing import (
    _arr,
    _backend,
    _check_float,
    _f32,
    _from_numpy,
    _into,
    _kernels,
    _out,
    _rows_in_place,
)

_TORCH_FORMATS = {
    torch.float16: floatfmt.FP16,
    torch.bfloat16: floatfmt.BF16,
    torch.float8_e4m3fn: floatfmt.FP8_E4M3,
    torch.float8_e5m2: floatfmt.FP8_E5M2,
}
_NAMED_FORMATS = {
    Precision.FP16: torch.float16,
    Precision.BF16: torch.bfloat16,
    Precision.FP8_E4M3: torch.float8_e4m3fn,
    Precision.FP8_E5M2: torch.float8_e5m2,
}


def _code_array(t):
    """Zero-copy unsigned view (uint8 or uint16) of a contiguous float-format tensor's codes."""
    if t.dtype.itemsize == 1:
        return _arr(t.view(torch.uint8))
    return _arr(t.view(torch.int16)).view("uint16")


def _torch_format(fmt):
    """The torch dtype of a named format (Precision, its name, or a torch dtype)."""
    if isinstance(fmt, torch.dtype):
        if fmt in _TORCH_FORMATS:
            return fmt
    elif isinstance(fmt, str):
        try:
            precision = Precision.parse(fmt)
        except QSyncError:
            precision = None
        if precision in _NAMED_FORMATS:
            return _NAMED_FORMATS[precision]
    raise QSyncError(
        f"unknown float format {fmt!r}; choose fp16, bf16, fp8_e4m3 or fp8_e5m2 "
        "(or an (exp_bits, man_bits) tuple for float_round)"
    )


def _format_tuple(fmt):
    if isinstance(fmt, tuple):
        if (
            len(fmt) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in fmt)
            or not (2 <= fmt[0] <= 8 and 0 <= fmt[1] <= 23)
        ):
            raise QSyncError(
                f"float format {fmt!r} is not (exp_bits, man_bits) with 2<=exp_bits<=8, "
                "0<=man_bits<=23"
            )
        return floatfmt.ieee_format(*fmt)
    return _TORCH_FORMATS[_torch_format(fmt)]


def float_encode(x, fmt, *, scale=None, backend="auto", out=None):
    """Cast to fp16, bf16, fp8 e4m3fn or fp8 e5m2: bit-exact with ``x.to(dtype)``.

    RNE with subnormals; fp16/bf16/e5m2 overflow to ±Inf, e4m3fn saturates to ±448 (Inf
    included), as torch does; NaNs get torch's encodings. With ``scale``, the cast of
    ``x.float() / scale`` (float32 division) in the same pass: the codes of
    :func:`float_quantize`, without its values.

    Args:
        x: float32/float16/bfloat16 tensor.
        fmt: "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", a Precision or the torch dtype.
        scale: optional divisor, a float or a one-element tensor.
        backend: "auto", "cpu", "cuda" or "reference".
        out: optional contiguous tensor of the format's dtype, x's shape and device.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import float_encode
        >>> float_encode(torch.tensor([500.0, 0.3]), "fp8_e4m3").float().tolist()
        [448.0, 0.3125]
    """
    _check_float(x)
    dtype = _torch_format(fmt)
    spec = _TORCH_FORMATS[dtype]
    be = _backend(x, backend)
    code_dtype = torch.uint8 if dtype.itemsize == 1 else torch.int16
    if scale is not None:
        scale = torch.as_tensor(scale, dtype=torch.float32).to(x.device).reshape(1)
        if be != "cpu":  # the division, then the cast
            x = x.detach().float() / scale[0]
    if be == "reference":
        codes = ref.encode_format(x.detach().cpu().float().numpy(), spec)
        codes = torch.from_numpy(codes.astype("uint8" if dtype.itemsize == 1 else "uint16"))
        res = codes.view(code_dtype).view(dtype).to(x.device)
        return res if out is None else _into(res, _out(out, x.shape, dtype, x.device))
    out = _out(out, x.shape, dtype, x.device)
    xf = _f32(x.detach())
    if x.numel() and scale is not None and be == "cpu":
        _kernels(be).float_encode_scaled(_arr(xf), _arr(scale), spec, _code_array(out))
    elif x.numel():
        _kernels(be).float_encode(_arr(xf).view("uint32"), spec, _code_array(out))
    return out


@functools.cache
def _decode_table(dtype, device):
    """float32 value of every code of ``dtype``, from torch's own cast, on ``device``."""
    codes = np.arange(256 ** dtype.itemsize, dtype=np.uint8 if dtype.itemsize == 1 else np.uint16)
    return torch.from_numpy(codes).view(dtype).float().to(device)


def float_decode(x, *, backend="auto", out=None):
    """Widen fp16, bf16, fp8 e4m3fn or fp8 e5m2 values to float32, as ``x.float()`` does.

    The CPU kernel decodes the bits arithmetically (``floatfmt.widen``; much faster than
    torch's own CPU fp8 cast); the CUDA kernel and the reference look codes up in a table of
    torch's cast of every code (NaNs included).

    Args:
        x: tensor of one of the four formats.
        backend: "auto", "cpu", "cuda" or "reference".
        out: optional contiguous float32 tensor of x's shape and device.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import float_decode
        >>> float_decode(torch.tensor([448.0, 0.3]).to(torch.float8_e4m3fn)).tolist()
        [448.0, 0.3125]
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _TORCH_FORMATS:
        raise QSyncError(
            "x must be a float16, bfloat16, float8_e4m3fn or float8_e5m2 torch.Tensor"
        )
    be = _backend(x, backend)
    if be == "reference":
        table = _decode_table(x.dtype, torch.device("cpu")).numpy()
        res = _from_numpy(table[_code_array(x.detach().cpu().contiguous())], x.device)
        res = res.reshape(x.shape)
        return res if out is None else _into(res, _out(out, x.shape, torch.float32, x.device))
    out = _out(out, x.shape, torch.float32, x.device)
    if x.numel():
        codes = _code_array(x.detach().contiguous())
        if be == "cpu":
            bits = _arr(out.view(torch.int32)).view("uint32")
            _kernels(be).float_decode(codes, _TORCH_FORMATS[x.dtype], bits)
        else:
            _kernels(be).float_decode(codes, _arr(_decode_table(x.dtype, x.device)), _arr(out))
    return out


def float_decode_sum(x, *, scale=1.0, backend="auto", out=None):
    """The float32 sum over ``x``'s first axis of its values widened to float32, added in
    turn, times ``scale``: ``(((0 + v_0) + v_1) + ...) · float32(scale)``, as adding each
    row's :func:`float_decode` to zeros and multiplying the sum does, bit for bit. For the
    ranks' payloads of an all-gather: on the CPU one pass over the sum (each block of it
    stays in cache while every row is added, then is scaled). The rows are read in place
    wherever they lie along the first axis's stride, as long as each is contiguous.

    Args:
        x: tensor of one of the four formats, at least 1-D, its rows along the first axis.
        scale: a finite number the sum is multiplied by (in float32).
        backend: "auto", "cpu", "cuda" or "reference".
        out: optional contiguous float32 tensor of shape ``x.shape[1:]`` on x's device.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import float_decode_sum
        >>> x = torch.tensor([[1.5, 2.0], [0.25, -2.0]]).to(torch.float8_e4m3fn)
        >>> float_decode_sum(x).tolist(), float_decode_sum(x, scale=0.5).tolist()
        ([1.75, 0.0], [0.875, 0.0])
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _TORCH_FORMATS or x.dim() < 1:
        raise QSyncError("x must be a float16, bfloat16, float8_e4m3fn or float8_e5m2 "
                         "torch.Tensor of at least one dimension (its rows along the first)")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not math.isfinite(scale):
        raise QSyncError(f"scale must be a finite number, got {scale!r}")
    be = _backend(x, backend)
    rows, shape = x.shape[0], tuple(x.shape[1:])
    if be == "reference":
        table = _decode_table(x.dtype, torch.device("cpu")).numpy()
        numel = math.prod(shape)
        values = table[_code_array(x.detach().cpu().contiguous())].reshape(rows, numel)
        total = np.zeros(numel, dtype=np.float32)
        for row in values:
            total += row
        total *= np.float32(scale)
        res = _from_numpy(total, x.device).reshape(shape)
        return res if out is None else _into(res, _out(out, shape, torch.float32, x.device))
    out = _out(out, shape, torch.float32, x.device)
    if rows == 0:
        return out.zero_()
    if out.numel():
        flat, stride = _rows_in_place(x.detach())
        codes = _code_array(flat)
        if be == "cpu":
            _kernels(be).float_decode_sum(codes, rows, stride, _TORCH_FORMATS[x.dtype],
                                          float(scale), _arr(out.view(-1)))
        else:
            _kernels(be).float_decode_sum(codes, rows, stride,
                                          _arr(_decode_table(x.dtype, x.device)), float(scale),
                                          _arr(out.view(-1)))
    return out


class FloatCodes(NamedTuple):
    """Float-format values (a tensor of the format's dtype) and the same values as float32."""

    codes: torch.Tensor
    values: torch.Tensor


def float_quantize(x, fmt, *, scale=None, backend="auto", out=None):
    """Cast ``x / scale`` to fp16, bf16, fp8 e4m3fn or fp8 e5m2 and widen it back, in one pass.

    The scaled cast of the FP8 training recipe, for an operand that is kept in the format and
    also computed with: ``codes`` is bit-exact with ``float_encode(x.float() / scale, fmt)``
    (float32 division; ``x`` itself when ``scale`` is None) and ``values`` with
    ``codes.float()``, from one read of ``x``.

    Args:
        x: float32/float16/bfloat16 tensor.
        fmt: "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", a Precision or the torch dtype.
        scale: optional divisor, a float or a one-element tensor (e.g. amax / max_finite).
        backend: "auto", "cpu", "cuda" or "reference".
        out: optional ``FloatCodes`` (or pair) of contiguous tensors of x's shape and device,
            the format's dtype and float32, written instead of new ones.

    Returns:
        FloatCodes(codes, values).

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import float_quantize
        >>> q = float_quantize(torch.tensor([500.0, 0.3]), "fp8_e4m3", scale=2.0)
        >>> q.codes.dtype, q.values.tolist()
        (torch.float8_e4m3fn, [256.0, 0.15625])
    """
    _check_float(x)
    dtype = _torch_format(fmt)
    be = _backend(x, backend)
    scale = torch.as_tensor(1.0 if scale is None else scale, dtype=torch.float32)
    scale = scale.to(x.device).reshape(1)  # read on the device: no host sync
    if be == "reference":
        y = x.detach().cpu().float() / scale.cpu()[0]
        codes = float_encode(y, dtype, backend=be).to(x.device)
        values = float_decode(codes, backend=be)
        if out is None:
            return FloatCodes(codes, values)
        return FloatCodes(_into(codes, _out(out[0], x.shape, dtype, x.device, "out codes")),
                          _into(values, _out(out[1], x.shape, torch.float32, x.device,
                                             "out values")))
    codes, values = (None, None) if out is None else out
    codes = _out(codes, x.shape, dtype, x.device, "out codes")
    values = _out(values, x.shape, torch.float32, x.device, "out values")
    if x.numel():
        bits = _arr(values.view(torch.int32)).view("uint32")
        _kernels(be).float_quantize(_arr(_f32(x.detach())), _arr(scale), _TORCH_FORMATS[dtype],
                                    _code_array(codes), bits)
    return FloatCodes(codes, values)


def _round(x, spec, p1, p2, be, out=None):
    if be == "reference":
        y = ref.round_scaled(x.detach().cpu().float().numpy(), p1, p2, spec)
        res = _from_numpy(y, x.device)
        return res if out is None else _into(res, _out(out, x.shape, torch.float32, x.device))
    out = _out(out, x.shape, torch.float32, x.device)
    xf = _f32(x.detach())
    if x.numel():
        _kernels(be).float_round(
            _arr(xf), p1, p2, spec, _arr(out.view(torch.int32)).view("uint32")
        )
    return out


def float_round(x, fmt, *, backend="auto", out=None):
    """Round to the nearest value of a float format, held in float32 (fake cast).

    ``fmt`` is a named format (as in ``float_encode``; then the result equals
    ``x.to(dtype).float()`` for every non-NaN input) or ``(exp_bits, man_bits)`` for an
    IEEE-like format as in CPD: bias ``2**(e-1)-1``, subnormals, RNE, top exponent reserved
    for Inf, a carry out of the top binade gives Inf. NaN keeps its bits; x is never changed
    (unless passed as ``out``: a contiguous float32 tensor of x's shape and device, x too).

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import float_round
        >>> float_round(torch.tensor([248.0, 0.1]), (4, 3)).tolist()
        [inf, 0.1015625]
    """
    _check_float(x)
    spec = _format_tuple(fmt)
    return _round(x, spec, 1.0, 1.0, _backend(x, backend), out)
