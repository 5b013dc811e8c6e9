"""Float-format casts: encode to, round to, and widen from a float format (one array, or the
sum of several ranks' rows), and the scaled cast of codes and values in one pass."""

import functools

import numpy as np
from numba import njit, prange

from .jit import _jit
from .layout import _SUM_BLOCK, _bounds, _nchunks
from .scalar import _encode_fn, _round_fn, ff_cast_value, ff_encode, ff_round, ff_widen

# The scalar source is ``floatfmt`` (shared with the CUDA kernels). With the format a run-time
# tuple, Numba's 64-bit integer typing keeps the vector lanes 64 bits wide; with the format a
# compile-time constant, LLVM folds the constants and narrows the hot loop to 32-bit lanes
# (twice the lanes per vector). So large arrays get a kernel compiled for their format (once
# per format and kernel, cached in memory and on disk: the closure's format is part of
# Numba's cache key), small ones the generic kernel; the scaled casts, whose formats are
# torch's four, always get their format's kernel. Formats with 2 <= E <= 7 and
# 1 <= M <= 22 (fp16, both fp8, most CPD formats) use ``floatfmt``'s ``*_narrow`` twins,
# which give the same bits for all 2**32 inputs in about half the operations (one FPU
# rounding instead of separate normal/subnormal/overflow paths); rounding to an E = 8 format
# (bf16, tf32) uses ``round_wide``, a few integer operations (also checked on all inputs).
SPECIALIZE_MIN = 1 << 18


@_jit(parallel=True)
def _float_encode(xb, fmt, out):
    for j in prange(xb.size):
        out[j] = ff_encode(xb[j], fmt)


@_jit(parallel=True)
def _float_round(x, p1, p2, fmt, out):
    xb = x.view(np.uint32)
    p1 = np.float32(p1)
    p2 = np.float32(p2)
    prescale = p1 != 1 or p2 != 1
    if prescale:
        for j in prange(x.size):
            out[j] = ff_round(np.float32(x[j] * p1 * p2).view(np.uint32), fmt)
    else:
        for j in prange(x.size):
            out[j] = ff_round(xb[j], fmt)


@functools.cache
def _encode_for(fmt):
    F = tuple(int(v) for v in fmt)
    encode = _encode_fn(F)

    @_jit(parallel=True)
    def kernel(xb, out):
        for j in prange(xb.size):
            out[j] = encode(xb[j], F)

    return kernel


@functools.cache
def _round_for(fmt, prescale):
    F = tuple(int(v) for v in fmt)
    rnd = _round_fn(F)

    if prescale:
        @_jit(parallel=True)
        def kernel(x, p1, p2, out):
            p1 = np.float32(p1)
            p2 = np.float32(p2)
            for j in prange(x.size):
                out[j] = rnd(np.float32(x[j] * p1 * p2).view(np.uint32), F)
    else:
        @_jit(parallel=True)
        def kernel(x, p1, p2, out):
            xb = x.view(np.uint32)
            for j in prange(x.size):
                out[j] = rnd(xb[j], F)

    return kernel


def float_encode(xb, fmt, out):
    """Codes of float32 bits ``xb`` in ``fmt`` (``out`` is uint8 or uint16)."""
    if xb.size >= SPECIALIZE_MIN:
        _encode_for(tuple(fmt))(xb, out)
    else:
        _float_encode(xb, tuple(fmt), out)


def float_round(x, p1, p2, fmt, out):
    """float32 bits of ``x * p1 * p2`` rounded to ``fmt`` into uint32 ``out``.

    With ``p1 == p2 == 1`` the input bits are used untouched (NaN payloads survive).
    """
    if x.size >= SPECIALIZE_MIN:
        prescale = np.float32(p1) != 1 or np.float32(p2) != 1
        _round_for(tuple(fmt), bool(prescale))(x, p1, p2, out)
    else:
        _float_round(x, p1, p2, tuple(fmt), out)


@functools.cache
def _decode_for(fmt):
    F = tuple(int(v) for v in fmt)

    @_jit(parallel=True)
    def kernel(codes, out):
        for j in prange(codes.size):
            out[j] = ff_widen(codes[j], F)

    return kernel


def float_decode(codes, fmt, out):
    """float32 bits (uint32 ``out``) of ``fmt`` codes (uint8 or uint16), as torch widens them,
    NaNs included: arithmetic on the bits (vectorises; a table lookup would not)."""
    _decode_for(tuple(fmt))(codes, out)


@functools.cache
def _decode_sum_for(fmt):
    F = tuple(int(v) for v in fmt)

    # the loops run over whole slices from 0: Numba then knows no index is negative, and
    # they vectorise (an offset index inside a prange body does not: 2-3x slower). They are
    # inlined into the kernel: a helper of its own would be linked by its name, the same for
    # every format's kernel, and of two kernels loaded from the disk cache into one process
    # the second would call the first's helper (another format's widening)
    @njit(inline="always")
    def widen_into(codes, out):
        for t in range(out.size):
            out[t] = np.float32(0) + np.uint32(ff_widen(codes[t], F)).view(np.float32)

    @njit(inline="always")
    def widen_add(codes, out):
        for t in range(out.size):
            out[t] += np.uint32(ff_widen(codes[t], F)).view(np.float32)

    @_jit(parallel=True)
    def kernel(codes, rows, stride, scale, out, nck):
        n = out.size
        for k in prange(nck):
            first, stop = _bounds(n, nck, k)
            for lo in range(first, stop, _SUM_BLOCK):
                hi = min(stop, lo + _SUM_BLOCK)
                widen_into(codes[lo:hi], out[lo:hi])
                for r in range(1, rows):
                    widen_add(codes[r * stride + lo:r * stride + hi], out[lo:hi])
                if scale != 1:
                    _multiply(out[lo:hi], scale)

    return kernel


def float_decode_sum(codes, rows, stride, fmt, scale, out):
    """float32 ``out`` = ``((0 + v_0) + v_1 + ...) * scale`` over ``rows`` rows of ``fmt``
    codes, ``stride`` codes apart in ``codes``, block by block: each block of ``out`` stays
    in cache while every row is added to it."""
    _decode_sum_for(tuple(fmt))(codes, rows, stride, np.float32(scale), out,
                                _nchunks(out.size))


@njit(error_model="numpy")
def _multiply(out, m):
    for t in range(out.size):
        out[t] = out[t] * m


@functools.cache
def _quantize_for(fmt):
    F = tuple(int(v) for v in fmt)
    encode = _encode_fn(F)
    rnd = _round_fn(F)

    @_jit(parallel=True, error_model="numpy")
    def kernel(x, scales, codes, values):
        s = scales[0]
        for j in prange(x.size):
            b = np.float32(x[j] / s).view(np.uint32)
            c = encode(b, F)
            codes[j] = c
            values[j] = ff_cast_value(b, c, rnd(b, F), F)

    return kernel


def float_quantize(x, scales, fmt, codes, values):
    """Codes of float32 ``x / scales[0]`` in ``fmt`` (uint8 or uint16) and the float32 bits
    of their values (uint32 ``values``), in one pass: the rounding shares the encoding's
    arithmetic."""
    _quantize_for(tuple(fmt))(x, scales, codes, values)


@functools.cache
def _encode_scaled_for(fmt):
    F = tuple(int(v) for v in fmt)
    encode = _encode_fn(F)

    @_jit(parallel=True, error_model="numpy")
    def kernel(x, scales, codes):
        s = scales[0]
        for j in prange(x.size):
            codes[j] = encode(np.float32(x[j] / s).view(np.uint32), F)

    return kernel


def float_encode_scaled(x, scales, fmt, codes):
    """Codes of float32 ``x / scales[0]`` in ``fmt`` (uint8 or uint16): the codes of
    :func:`float_quantize` without its values."""
    _encode_scaled_for(tuple(fmt))(x, scales, codes)
