"""Symmetric int8: quantize, dequantize (optionally into a float format), fake-quantize, and
the sum of several ranks' dequantized rows."""

import functools

import numpy as np
from numba import njit, prange

from .jit import _jit
from .layout import (_NOVEC, _SUM_BLOCK, _at, _bounds, _nchunks, _part, _period_stop,
                     _period_vector, _segment)
from .scalar import _round_fn, _uniform, ff_round


def _divisors(v):
    """Divisors of quantize: the scale, or 1 where it is 0 (all-zero channels get code 0)."""
    return np.where(v > 0, v, np.float32(1)).astype(np.float32)


@njit(error_model="numpy")
def _q_run(x, xi, out, div, lo, hi, stochastic, key, j0):
    """int8 codes of one run (``div`` a scalar or a period-vector slice); max |x| bits."""
    m = np.int32(0)
    if stochastic:
        jhi = np.uint32(j0 >> 32)
        for t in range(x.size):
            v = x[t] / _at(div, t)
            f = np.floor(v)
            q = f + np.float32(1) if _uniform(key, np.uint32(j0 + t), jhi) < v - f else f
            out[t] = np.int8(min(max(q, lo), hi))
            m = max(m, np.int32(xi[t] & 0x7FFFFFFF))
    else:
        for t in range(x.size):
            out[t] = np.int8(min(max(np.rint(x[t] / _at(div, t)), lo), hi))
            m = max(m, np.int32(xi[t] & 0x7FFFFFFF))
    return m


@_jit(parallel=True, error_model="numpy")
def _quantize(x, scales, inner, nch, divvec, qmax, stochastic, key, nck, out):
    n = x.size
    hi = np.float32(qmax)
    lo = -hi
    xi = x.view(np.int32)
    period = divvec.size
    part = np.zeros(nck, dtype=np.int64)
    for k in prange(nck):
        i, end = _bounds(n, nck, k)
        m = np.int32(0)
        while i < end:
            if period:
                p, stop = _period_stop(i, end, period)
                div = divvec[p : p + (stop - i)]
                r = _q_run(x[i:stop], xi[i:stop], out[i:stop], div, lo, hi, stochastic, key, i)
            else:
                c, stop = _segment(i, end, inner, nch)
                s = scales[c]
                d = s if s > 0 else np.float32(1)
                r = _q_run(x[i:stop], xi[i:stop], out[i:stop], d, lo, hi, stochastic, key, i)
            m = max(m, r)
            i = stop
        part[k] = m
    return part.max()


def quantize(x, scales, inner, nch, qmax, stochastic, key, out):
    """int8 codes of float32 ``x``: RNE ``rint(x/s)`` or stochastic, clamped to ±qmax.

    Returns the largest ``|x|`` bit pattern seen (an int), so a caller that has no abs-max
    pass of its own can check for NaN/Inf (``>= 0x7F800000``) without reading x again.
    """
    vec = _period_vector(scales, inner, nch)
    vec = _NOVEC if vec is None else _divisors(vec)
    return _quantize(x, scales, inner, nch, vec, qmax, stochastic, key, _nchunks(x.size), out)


@functools.cache
def _dequantize_for(fmt):
    """The dequantize kernel for an output format: float32 bits of ``q * s``, rounded to
    ``fmt`` in the same pass unless it is None."""
    F = None if fmt is None else tuple(int(v) for v in fmt)
    if F is None:
        @njit(error_model="numpy", inline="always")  # no symbol of its own: see _decode_sum_for
        def run(q, out, s):
            for t in range(q.size):
                out[t] = np.float32(np.float32(q[t]) * _at(s, t)).view(np.uint32)
    else:
        rnd = _round_fn(F)

        @njit(error_model="numpy", inline="always")
        def run(q, out, s):
            for t in range(q.size):
                out[t] = rnd(np.float32(np.float32(q[t]) * _at(s, t)).view(np.uint32), F)

    @_jit(parallel=True, error_model="numpy")
    def kernel(q, scales, inner, nch, svec, nck, out):
        n = q.size
        period = svec.size
        for k in prange(nck):
            i, end = _bounds(n, nck, k)
            while i < end:
                if period:
                    p, stop = _period_stop(i, end, period)
                    run(q[i:stop], out[i:stop], svec[p : p + (stop - i)])
                else:
                    c, stop = _segment(i, end, inner, nch)
                    run(q[i:stop], out[i:stop], scales[c])
                i = stop

    return kernel


def dequantize(q, scales, inner, nch, out, fmt=None):
    """``q * s`` in float32 (bits into uint32 ``out``), rounded to ``fmt`` when given (one
    pass either way)."""
    vec = _period_vector(scales, inner, nch)
    kernel = _dequantize_for(None if fmt is None else tuple(fmt))
    kernel(q, scales, inner, nch, _NOVEC if vec is None else vec, _nchunks(q.size), out)


_FQ_BLOCK = 512


@njit(error_model="numpy")
def _fq_value(xt, st, stochastic, key, lo, hi):
    """``q * s`` (float32) of one element (index ``hi * 2**32 + lo``) with scale ``st``."""
    div = st if st > 0 else np.float32(1)
    v = xt / div
    if stochastic:
        f = np.floor(v)
        q = f + np.float32(1) if _uniform(key, lo, hi) < v - f else f
    else:
        q = np.rint(v)
    return min(max(q, np.float32(-127)), np.float32(127)) * st


@njit(error_model="numpy")
def _fq_block(x, out, s, stochastic, key, j0, out_fmt, reround, sq):
    # Separate simple loops over one block (in L1): each vectorises (a loop with a call, a
    # per-element flag test or a float reduction would not).
    hi = np.uint32(j0 >> 32)
    if stochastic:
        for t in range(x.size):
            out[t] = _fq_value(x[t], _at(s, t), True, key, np.uint32(j0 + t), hi)
    else:
        for t in range(x.size):
            out[t] = _fq_value(x[t], _at(s, t), False, key, np.uint32(j0 + t), hi)
    if reround:
        ob = out.view(np.uint32)
        for t in range(x.size):
            ob[t] = ff_round(ob[t], out_fmt)
    for t in range(x.size):
        d = np.float64(out[t]) - np.float64(x[t])
        sq[t] = d * d


@njit
def _sum4(sq, m):
    """Sum of ``sq[:m]`` with four accumulators (a float reduction LLVM may not reorder)."""
    a0 = a1 = a2 = a3 = 0.0
    m4 = m - m % 4
    for t in range(0, m4, 4):
        a0 += sq[t]
        a1 += sq[t + 1]
        a2 += sq[t + 2]
        a3 += sq[t + 3]
    for t in range(m4, m):
        a0 += sq[t]
    return (a0 + a1) + (a2 + a3)


@njit
def _fq_run(x, out, s, stochastic, key, j0, out_fmt, reround, sq):
    """Fake-quantize one run; returns the float64 sum of squared errors.

    Blocks of ``_FQ_BLOCK`` elements write their squared errors to the scratch ``sq`` (so the
    element loop has no loop-carried float dependency and vectorises), then sum them.
    """
    acc = 0.0
    for b0 in range(0, x.size, _FQ_BLOCK):
        b1 = min(x.size, b0 + _FQ_BLOCK)
        _fq_block(x[b0:b1], out[b0:b1], _part(s, b0, b1), stochastic, key, j0 + b0, out_fmt,
                  reround, sq)
        acc += _sum4(sq, b1 - b0)
    return acc


@_jit(parallel=True, error_model="numpy")
def _fake_quantize(x, scales, inner, nch, svec, stochastic, key, out_fmt, nck, out, sse_out):
    n = x.size
    sse = np.zeros(nck, dtype=np.float64)
    reround = out_fmt[1] < 23
    period = svec.size
    for k in prange(nck):
        i, end = _bounds(n, nck, k)
        sq = np.empty(_FQ_BLOCK, dtype=np.float64)
        acc = 0.0
        while i < end:
            if period:
                p, stop = _period_stop(i, end, period)
                acc += _fq_run(x[i:stop], out[i:stop], svec[p : p + (stop - i)], stochastic,
                               key, i, out_fmt, reround, sq)
            else:
                c, stop = _segment(i, end, inner, nch)
                acc += _fq_run(x[i:stop], out[i:stop], scales[c], stochastic, key, i, out_fmt,
                               reround, sq)
            i = stop
        sse[k] = acc
    sse_out[0] = sse.sum()


def fake_quantize(x, scales, inner, nch, stochastic, key, out_fmt, out, sse_out):
    """Quantize, dequantize, round to ``out_fmt``; float64 sum of squared error to sse_out[0]."""
    vec = _period_vector(scales, inner, nch)
    _fake_quantize(x, scales, inner, nch, _NOVEC if vec is None else vec, stochastic, key,
                   tuple(out_fmt), _nchunks(x.size), out, sse_out)


@njit(error_model="numpy")
def _scaled_into(q, s, out):
    for t in range(out.size):
        out[t] = np.float32(0) + np.float32(np.float32(q[t]) * s)


@njit(error_model="numpy")
def _scaled_add(q, s, out):
    for t in range(out.size):
        out[t] += np.float32(np.float32(q[t]) * s)


@njit(error_model="numpy")
def _divide(out, d):
    for t in range(out.size):
        out[t] = out[t] / d


@_jit(parallel=True, error_model="numpy")
def _dequantize_sum(q, stride, scales, divisor, out, nck):
    n = out.size
    for k in prange(nck):
        first, stop = _bounds(n, nck, k)
        for lo in range(first, stop, _SUM_BLOCK):  # whole slices: the loops vectorise
            hi = min(stop, lo + _SUM_BLOCK)
            _scaled_into(q[lo:hi], scales[0], out[lo:hi])
            for r in range(1, scales.size):
                _scaled_add(q[r * stride + lo:r * stride + hi], scales[r], out[lo:hi])
            if divisor != 1:
                _divide(out[lo:hi], divisor)


def dequantize_sum(q, stride, scales, divisor, out):
    """float32 ``out`` = ``(((0 + q_0 s_0) + q_1 s_1) + ...) / divisor`` over the int8 rows
    ``q[r * stride:][:out.size]``, each product rounded to float32, block by block: each
    block of ``out`` stays in cache while every row is added to it."""
    _dequantize_sum(q, stride, scales, np.float32(divisor), out, _nchunks(out.size))
