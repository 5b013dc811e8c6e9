"""Shared plumbing of the torch-facing API: backend choice, argument checks, buffers.

Backend selection (``_backend``, ``_kernels``; the Numba modules are imported on first use),
the argument checks every routine family shares, zero-copy tensor views for the kernels and
output buffers (``_out``/``_into``/``_empty``, with transparent huge pages for large CPU
buffers). The conventions these implement are in the package docstring (``__init__.py``).
"""

import functools
import math

import numpy as np
import torch

from qsync_lab.errors import QSyncError

BACKENDS = ("auto", "cpu", "cuda", "reference")
ROUNDINGS = ("nearest", "stochastic")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


def exact_div_(t: torch.Tensor, d: float) -> torch.Tensor:
    """Divide ``t`` in place by the number ``d``, correctly rounded on every device, and
    return it. (For a Python-number divisor, torch's CUDA kernels multiply by ``1/d``: a
    second rounding, so the CPU and the GPU would differ in the last bit.)

    Example::

        >>> exact_div_(torch.tensor([1.0, 3.0]), 3).tolist()
        [0.3333333432674408, 1.0]
    """
    return t.div_(torch.full((), d, dtype=t.dtype, device=t.device))


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


def _check_workers(n_workers, limit=None):
    if not isinstance(n_workers, int) or isinstance(n_workers, bool) or n_workers < 1:
        raise QSyncError(f"n_workers must be a positive int, got {n_workers!r}")
    if limit is not None and n_workers > limit:
        raise QSyncError(f"n_workers={n_workers} leaves no int8 level; use at most {limit}")
    return n_workers


def _nan_error(what="x"):
    return QSyncError(
        f"{what} contains NaN or Inf; quantization needs finite values: "
        "fix the tensor (e.g. torch.nan_to_num) before quantizing"
    )


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


def _from_numpy(a, device):
    return torch.from_numpy(np.asarray(a)).to(device)


def _rows_in_place(rows):
    """A flat view from the first of ``rows`` (a tensor's slices along its first axis, at
    least one) to the end of its last, and the row stride in elements: the rows read in
    place (a contiguous copy first where a row is not contiguous)."""
    numel = rows[0].numel()
    if rows.shape[0] == 1 or not rows[0].is_contiguous() or rows.stride(0) < numel:
        rows = rows.contiguous()
    stride = rows.stride(0) if rows.shape[0] > 1 else numel
    return rows.as_strided(((rows.shape[0] - 1) * stride + numel,), (1,)), stride
