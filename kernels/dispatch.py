"""Torch-facing quantization API: validates, converts tensors zero-copy, picks a backend.

Backends (``backend=``): ``"auto"`` (CUDA kernels for CUDA tensors, CPU kernels otherwise),
``"cpu"`` (Numba ``njit(parallel=True)``), ``"cuda"`` (Numba ``cuda.jit``; CUDA tensors, or
CPU tensors under ``NUMBA_ENABLE_CUDASIM=1``) and ``"reference"`` (NumPy, ``reference.py``).
Numba is imported, and kernels compiled, on first use only; the CPU kernels are also cached
on disk (Numba's ``cache=True``, see ``cpu.py``), so later processes load them in well under a
second instead of compiling for ~20 s.

Conventions:

* Inputs may be float32, float16 or bfloat16, on CPU or CUDA, contiguous or not.
  Kernels read float32: fp16/bf16 inputs, and non-contiguous ones, are first made
  contiguous float32 by one documented copy (``x.to(torch.float32).contiguous()``, exact);
  a contiguous float32 tensor is used in place. ``absmax`` reads fp16/bf16 bits directly.
* Outputs are new tensors on the input's device, written in place by the kernels, or the
  caller's ``out=`` tensor (quantize/dequantize/fake-quantize/float casts/APS): it must be
  contiguous with the result's exact shape, dtype and device (else QSyncError), and is
  overwritten. Reusing ``out=`` skips the allocation and its first-touch page faults, which
  on CPU cost as much as the kernel itself for large tensors. New CPU outputs of 4 MiB or
  more are advised as transparent huge pages (``madvise(MADV_HUGEPAGE)`` on that buffer only,
  Linux; a no-op elsewhere), which makes first touch ~4x cheaper.
* CPU threads: Numba's default threading layer and thread count (``NUMBA_NUM_THREADS``) are
  used as is; nothing here changes process-wide settings. torch and Numba each run an OpenMP
  pool (two libgomp copies). Keep libgomp's default wait policy (a bounded spin) when mixing
  both in a hot loop: ``OMP_WAIT_POLICY=PASSIVE`` makes every parallel region wake sleeping
  threads, measured on a 2-core VM at 50-150 µs per kernel call (vs 1-20 µs) and 1.6x on a
  256x256 torch matmul.
* NaN/Inf: ``absmax`` propagates NaN like ``torch.amax``; the float-format casts handle them
  exactly like torch's casts; every integer quantizer (int8, Global-QSGD, CGX, QSGD) raises
  QSyncError, found by the abs-max (or norm) pass it needs anyway.
* Stochastic rounding draws ``u`` from a counter hash of (seed, element index), so CPU,
  CUDA and reference agree bit for bit and reruns are reproducible.
"""

import functools
import math
from typing import NamedTuple

import numpy as np
import torch

from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision

from . import floatfmt
from . import reference as ref
from .rng import rng_key

BACKENDS = ("auto", "cpu", "cuda", "reference")
ROUNDINGS = ("nearest", "stochastic")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
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
_OUT_FORMAT = {torch.float32: floatfmt.FP32, **_TORCH_FORMATS}
_ABS_MASK = {torch.float32: 0x7FFFFFFF, torch.float16: 0x7FFF, torch.bfloat16: 0x7FFF}
_BITS_DTYPE = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


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


class QSGDCodes(NamedTuple):
    """QSGD codes in [-levels, levels] with the float32 L2 norm they are scaled by."""

    codes: torch.Tensor
    norm: float
    levels: int


class CGXPacked(NamedTuple):
    """CGX bucketed max-min codes: packed payload, (min, unit) per bucket, and layout."""

    payload: torch.Tensor
    meta: torch.Tensor
    shape: tuple
    dtype: torch.dtype
    bits: int
    bucket_size: int


# ----------------------------------------------------------------------------- plumbing


@functools.cache
def _cpu():
    from . import cpu

    return cpu


@functools.cache
def _cuda():
    from . import cuda

    return cuda


def _simulator():
    from numba.core import config

    return bool(config.ENABLE_CUDASIM)


def _backend(x, backend):
    if backend not in BACKENDS:
        raise QSyncError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "cuda" if x.is_cuda else "cpu"
    if backend == "cpu" and x.is_cuda:
        raise QSyncError("backend='cpu' needs a CPU tensor; move it with .cpu() or use 'auto'")
    if backend == "cuda" and not x.is_cuda and not _simulator():
        raise QSyncError(
            "backend='cuda' needs a CUDA tensor (or NUMBA_ENABLE_CUDASIM=1); "
            "move it with .cuda() or use 'auto'"
        )
    return backend


def _kernels(backend):
    return _cuda() if backend == "cuda" else _cpu()


def _arr(t):
    """Zero-copy NumPy (CPU) or Numba device (CUDA) view of a contiguous tensor, flattened."""
    t = t.reshape(-1)
    if t.is_cuda:
        from numba import cuda

        return cuda.as_cuda_array(t)
    return t.numpy()


def _check_float(x, name="x"):
    if not isinstance(x, torch.Tensor):
        raise QSyncError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise QSyncError(
            f"{name} has dtype {x.dtype}; pass a float32, float16 or bfloat16 tensor"
        )


def _f32(x):
    """Contiguous float32 version of x (x itself when it already is one)."""
    return x.to(torch.float32).contiguous()


def _geometry(x, axis):
    """(axis, inner, nch) of the row view used by the kernels."""
    if axis is None:
        return None, max(x.numel(), 1), 1
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise QSyncError(f"axis must be an int or None, got {axis!r}")
    if not -x.dim() <= axis < x.dim():
        raise QSyncError(
            f"axis {axis} is out of range for a tensor with {x.dim()} dimensions; "
            f"use -{x.dim()}..{x.dim() - 1} or None for per-tensor"
            if x.dim()
            else f"axis {axis} given for a 0-dim tensor; use axis=None"
        )
    axis = axis % x.dim()
    inner = math.prod(x.shape[axis + 1 :])
    return axis, max(inner, 1), max(x.shape[axis], 1)


def _check_rounding(rounding):
    if rounding not in ROUNDINGS:
        raise QSyncError(f"unknown rounding {rounding!r}; choose 'nearest' or 'stochastic'")
    return rounding == "stochastic"


def _check_seed(seed):
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise QSyncError(f"seed must be an int in [0, 2**63), got {seed!r}")
    return seed


def _nan_error(what="x"):
    return QSyncError(
        f"{what} contains NaN or Inf; quantization needs finite values: "
        "fix the tensor (e.g. torch.nan_to_num) before quantizing"
    )


def _bits_to_float(bits, dtype):
    """Convert abs-max bit patterns (int64) of ``dtype`` to float32 values."""
    if dtype == torch.float32:
        return bits.to(torch.int32).view(torch.float32)
    if dtype == torch.bfloat16:
        return (bits.to(torch.int32) << 16).view(torch.float32)
    return bits.to(torch.int16).view(torch.float16).to(torch.float32)


_HUGE_MIN = 4 << 20
_HUGE = 1 << 21


@functools.cache
def _madvise():
    """libc ``madvise`` (or None where there is none, or THP is off)."""
    try:
        import ctypes
        import sys

        if not sys.platform.startswith("linux"):
            return None
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


def _empty(shape, dtype, device=None):
    """``torch.empty`` whose large CPU buffers are advised as transparent huge pages.

    A fresh 256 MB output takes 65,536 4-KiB page faults on first touch (more time than the
    kernel itself); with huge pages it takes 128. Only this buffer's aligned interior is
    advised; the memory is released as usual when the tensor dies.
    """
    t = torch.empty(shape, dtype=dtype, device=device)
    nbytes = t.numel() * t.element_size()
    if nbytes >= _HUGE_MIN and not t.is_cuda:
        madvise = _madvise()
        if madvise is not None:
            p = t.data_ptr()
            lo = -(-p // _HUGE) * _HUGE
            hi = (p + nbytes) // _HUGE * _HUGE
            if hi > lo:
                madvise(lo, hi - lo, 14)  # MADV_HUGEPAGE; advisory, failure is harmless
    return t


def _out(out, shape, dtype, device, name="out"):
    """The caller's ``out`` after validation, or a new tensor when it is None."""
    if out is None:
        return _empty(shape, dtype, device)
    if not isinstance(out, torch.Tensor):
        raise QSyncError(f"{name} must be a torch.Tensor or None, got {type(out).__name__}")
    shape = tuple(shape)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != torch.device(device) \
            or not out.is_contiguous():
        raise QSyncError(
            f"{name} must be a contiguous {dtype} tensor of shape {shape} on {device}; got "
            f"{'' if out.is_contiguous() else 'non-contiguous '}{out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    return out


def _into(result, out):
    """``result`` copied into the caller's ``out`` (when given and not already it)."""
    if out is None or out is result:
        return result
    out.copy_(result)
    return out


def _code_array(t):
    """Zero-copy unsigned view (uint8 or uint16) of a contiguous float-format tensor's codes."""
    if t.dtype.itemsize == 1:
        return _arr(t.view(torch.uint8))
    return _arr(t.view(torch.int16)).view("uint16")


def _from_numpy(a, device):
    return torch.from_numpy(np.asarray(a)).to(device)


# ----------------------------------------------------------------------------- abs-max


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


# ----------------------------------------------------------------------------- int8


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
        scale = (amax / 127).reshape(-1).contiguous()
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
    scale = (amax / 127).reshape(-1).contiguous()
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


# ----------------------------------------------------------------------------- float formats


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


def float_encode(x, fmt, *, backend="auto", out=None):
    """Cast to fp16, bf16, fp8 e4m3fn or fp8 e5m2: bit-exact with ``x.to(dtype)``.

    RNE with subnormals; fp16/bf16/e5m2 overflow to ±Inf, e4m3fn saturates to ±448 (Inf
    included), as torch does; NaNs get torch's encodings.

    Args:
        x: float32/float16/bfloat16 tensor.
        fmt: "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", a Precision or the torch dtype.
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
    if be == "reference":
        codes = ref.encode_format(x.detach().cpu().float().numpy(), spec)
        codes = torch.from_numpy(codes.astype("uint8" if dtype.itemsize == 1 else "uint16"))
        res = codes.view(code_dtype).view(dtype).to(x.device)
        return res if out is None else _into(res, _out(out, x.shape, dtype, x.device))
    out = _out(out, x.shape, dtype, x.device)
    xf = _f32(x.detach())
    if x.numel():
        _kernels(be).float_encode(_arr(xf).view("uint32"), spec, _code_array(out))
    return out


@functools.cache
def _decode_table(dtype, device):
    """float32 value of every code of ``dtype``, from torch's own cast, on ``device``."""
    codes = np.arange(256 ** dtype.itemsize, dtype=np.uint8 if dtype.itemsize == 1 else np.uint16)
    return torch.from_numpy(codes).view(dtype).float().to(device)


def float_decode(x, *, backend="auto", out=None):
    """Widen fp16, bf16, fp8 e4m3fn or fp8 e5m2 values to float32, as ``x.float()`` does.

    The CPU kernel decodes the bits arithmetically (``floatfmt.widen``; fp8 at 786K elements
    ~25 µs, vs ~1 ms for torch's own fp8 cast); the CUDA kernel and the reference look codes
    up in a table of torch's cast of every code (NaNs included).

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


class FloatCodes(NamedTuple):
    """Float-format values (a tensor of the format's dtype) and the same values as float32."""

    codes: torch.Tensor
    values: torch.Tensor


def float_quantize(x, fmt, *, scale=None, backend="auto"):
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
        return FloatCodes(codes, float_decode(codes, backend=be))
    codes = _empty(x.shape, dtype, x.device)
    values = _empty(x.shape, torch.float32, x.device)
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


# ----------------------------------------------------------------------------- APS


APS_ZERO_EXPONENT = ref.APS_ZERO_EXPONENT


def _check_workers(n_workers, limit=None):
    if not isinstance(n_workers, int) or isinstance(n_workers, bool) or n_workers < 1:
        raise QSyncError(f"n_workers must be a positive int, got {n_workers!r}")
    if limit is not None and n_workers > limit:
        raise QSyncError(f"n_workers={n_workers} leaves no int8 level; use at most {limit}")
    return n_workers


def aps_exponent(x, n_workers, *, backend="auto"):
    """APS: this worker's ``ceil(log2(max |n_workers · x|))`` (all-reduce MAX it across workers).

    An all-zero tensor gives ``APS_ZERO_EXPONENT`` (-150, below any real exponent) instead
    of CPD's -inf. NaN/Inf raise QSyncError.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import aps_exponent
        >>> aps_exponent(torch.tensor([0.3, -1.5]), 4)
        3
    """
    _check_float(x)
    _check_workers(n_workers)
    amax = float(_finite_absmax(x, None, _backend(x, backend)))
    if amax == 0:
        return APS_ZERO_EXPONENT
    frac, ex = math.frexp(amax * n_workers)
    return ex if frac > 0.5 else ex - 1


def aps_shift(exponent, fmt):
    """APS: the power-of-two shift ``(2**(e-1) - 1) - exponent`` for format ``fmt``.

    Example::

        >>> from qsync_lab.kernels import aps_shift
        >>> aps_shift(3, (5, 2))
        12
    """
    return ref.aps_shift(int(exponent), _format_tuple(fmt))


def aps_quantize(x, shift, fmt, *, backend="auto", out=None):
    """APS: round ``x · 2**shift`` (exact scaling) to ``fmt``; the values stay scaled.

    ``out``: optional contiguous float32 tensor of x's shape and device.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import aps_quantize
        >>> aps_quantize(torch.tensor([0.3]), 4, (5, 2)).tolist()
        [5.0]
    """
    _check_float(x)
    p1, p2 = ref.pow2_factors(int(shift))
    return _round(x, _format_tuple(fmt), p1, p2, _backend(x, backend), out)


def aps_dequantize(y, shift, *, backend="auto"):
    """APS: undo the scaling, ``y · 2**-shift`` (float32).

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import aps_dequantize
        >>> aps_dequantize(torch.tensor([5.0]), 4).tolist()
        [0.3125]
    """
    _check_float(y, "y")
    p1, p2 = ref.pow2_factors(-int(shift))
    return _round(y, floatfmt.FP32, p1, p2, _backend(y, backend))


# ----------------------------------------------------------------------------- Global-QSGD


def _check_global_max(x, global_max, be):
    m = float(global_max)
    if not math.isfinite(m) or m < 0:
        raise QSyncError(f"global_max must be finite and >= 0, got {m}; all-reduce MAX absmax(x)")
    local = float(_finite_absmax(x, None, be))
    if local > m:
        raise QSyncError(
            f"global_max={m} is below this tensor's max |x| = {local}; "
            "pass the all-reduced MAX of absmax over all workers"
        )
    return m


def global_qsgd_encode(x, global_max, n_workers, *, dithering="standard", seed=0,
                       backend="auto"):
    """Global-QSGD encode with a shared scale ``global_max`` (M, the max |x| over workers).

    ``"standard"``: int8 codes in [-L, L], ``L = 127 // n_workers``, stochastic rounding of
    ``x / (M/L)`` (unbiased), so n workers' codes sum in int8 without overflow.
    ``"exponential"``: uint8 codes, sign bit + 7-bit exponent c (value ``M·2**-(c-1)``,
    0 = zero), unbiased randomized rounding between neighbouring powers of two.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import global_qsgd_encode
        >>> global_qsgd_encode(torch.tensor([1.0, -0.5]), 1.0, 2).tolist()
        [63, -32]
    """
    _check_float(x)
    _check_seed(seed)
    be = _backend(x, backend)
    if dithering == "standard":
        levels, unit = ref.qsgd_levels_scale(
            _check_global_max(x, global_max, be), _check_workers(n_workers, 127)
        )
        scale = torch.full((1,), float(unit), dtype=torch.float32, device=x.device)
        return _quantize(x, None, scale, levels, True, seed, be)
    if dithering != "exponential":
        raise QSyncError(f"unknown dithering {dithering!r}; choose 'standard' or 'exponential'")
    _check_workers(n_workers)
    m = _check_global_max(x, global_max, be)
    if be == "reference":
        codes = ref.exp_dither_encode(x.detach().cpu().float().numpy(), m, seed)
        return _from_numpy(codes, x.device)
    codes = _empty(x.shape, dtype=torch.uint8, device=x.device)
    if x.numel():
        _kernels(be).exp_dither_encode(_arr(_f32(x.detach())), float(m), rng_key(seed),
                                       _arr(codes))
    return codes


def global_qsgd_decode(codes, global_max, n_workers, *, dithering="standard", backend="auto"):
    """Decode Global-QSGD codes (a worker's, or for "standard" the int8 sum over workers).

    Returns float32 values; divide a decoded sum by n_workers for the mean.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import global_qsgd_decode
        >>> global_qsgd_decode(torch.tensor([63, -32], dtype=torch.int8), 1.0, 2).tolist()
        [1.0, -0.5079365372657776]
    """
    m = float(global_max)
    if dithering == "standard":
        levels, unit = ref.qsgd_levels_scale(m, _check_workers(n_workers, 127))
        return dequantize_int8(codes, torch.tensor(float(unit)), backend=backend)
    if dithering != "exponential":
        raise QSyncError(f"unknown dithering {dithering!r}; choose 'standard' or 'exponential'")
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise QSyncError("exponential codes must be a uint8 torch.Tensor (from global_qsgd_encode)")
    be = _backend(codes, backend)
    if be == "reference":
        return _from_numpy(ref.exp_dither_decode(codes.cpu().numpy(), m), codes.device)
    out = _empty(codes.shape, dtype=torch.float32, device=codes.device)
    if codes.numel():
        _kernels(be).exp_dither_decode(_arr(codes.contiguous()), m, _arr(out))
    return out


# ----------------------------------------------------------------------------- CGX


def cgx_encode(x, bits, bucket_size=512, *, rounding="stochastic", seed=0, backend="auto"):
    """CGX bucketed max-min quantization to ``bits`` (1..8) bits, bit-packed.

    Per bucket of ``bucket_size`` consecutive elements: ``unit = (max - min)/(2**b - 1)``
    (float32 metadata), codes ``floor((x - min)/unit + r)`` clamped to [0, 2**b - 1] with
    ``r`` uniform ("stochastic", unbiased) or 0.5 ("nearest"). Codes are packed
    little-endian, 8 codes per ``bits`` bytes.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import cgx_decode, cgx_encode
        >>> p = cgx_encode(torch.tensor([0.0, 1.0, 2.0, 3.0]), 2, rounding="nearest")
        >>> p.payload.tolist(), cgx_decode(p).tolist()
        ([[228, 0]], [0.0, 1.0, 2.0, 3.0])
    """
    _check_float(x)
    stochastic = _check_rounding(rounding)
    _check_seed(seed)
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise QSyncError(f"bits must be an int in 1..8, got {bits!r}")
    if not isinstance(bucket_size, int) or bucket_size < 1:
        raise QSyncError(f"bucket_size must be a positive int, got {bucket_size!r}")
    be = _backend(x, backend)
    _finite_absmax(x, None, be)
    n = x.numel()
    groups = -(-n // bucket_size)
    levels = (1 << bits) - 1
    if be == "reference":
        xf = x.detach().cpu().float().numpy()
        meta = ref.cgx_meta(xf, bucket_size, bits)
        codes = ref.cgx_codes(xf, meta, bucket_size, bits, stochastic, seed)
        payload = ref.pack_bits(codes, bits).reshape(-1, bits) if n else None
        payload = _from_numpy(payload, x.device) if n else _empty((0, bits), dtype=torch.uint8)
        meta = _from_numpy(meta, x.device)
    else:
        xf = _f32(x.detach())
        meta = _empty((groups, 2), dtype=torch.float32, device=x.device)
        payload = _empty((-(-n // 8), bits), dtype=torch.uint8, device=x.device)
        if n:
            k = _kernels(be)
            k.cgx_meta(_arr(xf), bucket_size, levels, _arr(meta).reshape(groups, 2))
            k.cgx_encode(_arr(xf), _arr(meta).reshape(groups, 2), bucket_size, bits, stochastic,
                         rng_key(seed), _arr(payload))
    return CGXPacked(payload.to(x.device), meta, tuple(x.shape), x.dtype, bits, bucket_size)


def cgx_decode(packed, *, backend="auto"):
    """Unpack CGX codes and return ``min + unit·q`` in the original shape and dtype."""
    if not isinstance(packed, CGXPacked):
        raise QSyncError("cgx_decode takes the CGXPacked returned by cgx_encode")
    payload, meta = packed.payload, packed.meta
    be = _backend(payload, backend)
    n = math.prod(packed.shape)
    if be == "reference":
        codes = ref.unpack_bits(payload.cpu().numpy().reshape(-1), packed.bits, n)
        out = _from_numpy(ref.cgx_decode_codes(codes, meta.cpu().numpy(), packed.bucket_size),
                          payload.device)
    else:
        out = _empty(n, dtype=torch.float32, device=payload.device)
        if n:
            _kernels(be).cgx_decode(_arr(payload.contiguous()), _arr(meta).reshape(-1, 2),
                                    packed.bucket_size, packed.bits, _arr(out))
    return out.reshape(packed.shape).to(packed.dtype)


# ----------------------------------------------------------------------------- QSGD


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


def _check_levels(levels):
    if not isinstance(levels, int) or isinstance(levels, bool) or not 1 <= levels <= 127:
        raise QSyncError(f"levels must be an int in 1..127, got {levels!r}")
    return levels


def qsgd_encode(x, levels, *, seed=0, norm=None, backend="auto"):
    """QSGD: ``s = levels`` levels scaled by the L2 norm, stochastic rounding (unbiased).

    Codes are int8 in [-s, s] with ``x̂ = code · float32(norm) / s``. ``norm`` defaults to
    ``l2norm(x)``; pass it to reuse one (e.g. computed elsewhere).

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import qsgd_encode
        >>> qsgd_encode(torch.tensor([3.0, 4.0]), 5).codes.tolist()
        [3, 4]
    """
    _check_float(x)
    _check_levels(levels)
    _check_seed(seed)
    be = _backend(x, backend)
    if norm is None:
        norm = l2norm(x, backend=be)
    if not math.isfinite(norm) or norm < 0:
        raise _nan_error()
    scale = torch.full((1,), float(ref.qsgd_scale(norm, levels)), device=x.device)
    return QSGDCodes(_quantize(x, None, scale, levels, True, seed, be), float(norm), levels)


def qsgd_decode(codes, norm, levels, *, backend="auto"):
    """QSGD: ``codes · float32(norm) / levels`` as float32.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import qsgd_decode
        >>> qsgd_decode(torch.tensor([3, 4], dtype=torch.int8), 5.0, 5).tolist()
        [3.0, 4.0]
    """
    _check_levels(levels)
    scale = torch.tensor(float(ref.qsgd_scale(norm, levels)))
    return dequantize_int8(codes, scale, backend=backend)
