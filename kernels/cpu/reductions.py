"""Reductions: per-channel abs-max on float bit patterns, and the float64 sum of squares."""

import numpy as np
from numba import njit, prange

from .jit import _jit
from .layout import VEC_INNER, VEC_MIN, _bounds, _nchunks, _period_stop, _segment

_ABSMAX_PART_MAX = 1 << 21  # largest (chunks x period) partial-max array of a periodic abs-max


@njit
def _max_bits(xb, m0):
    m = xb.dtype.type(0)
    for t in range(xb.size):
        m = max(m, xb.dtype.type(xb[t] & m0))
    return m


@njit
def _max_bits_into(xb, acc, m0):
    for t in range(xb.size):
        acc[t] = max(acc[t], xb.dtype.type(xb[t] & m0))


@_jit(parallel=True)
def _absmax_rows(xb, mask, inner, nch, nck, out):
    n = xb.size
    part = np.zeros((nck, nch), dtype=np.int64)
    m0 = xb.dtype.type(mask)
    for k in prange(nck):
        i, end = _bounds(n, nck, k)
        while i < end:
            c, stop = _segment(i, end, inner, nch)
            part[k, c] = max(part[k, c], np.int64(_max_bits(xb[i:stop], m0)))
            i = stop
    for c in range(nch):
        out[c] = 0
    for k in range(nck):
        for c in range(nch):
            out[c] = max(out[c], part[k, c])


@_jit(parallel=True)
def _absmax_periodic(xb, mask, part):
    """``part[k, p]`` = max of ``xb & mask`` over chunk k's elements at period position p."""
    n = xb.size
    nck, period = part.shape
    m0 = xb.dtype.type(mask)
    for k in prange(nck):
        i, end = _bounds(n, nck, k)
        acc = part[k]
        while i < end:
            p, stop = _period_stop(i, end, period)
            _max_bits_into(xb[i:stop], acc[p : p + (stop - i)], m0)
            i = stop


def absmax_bits(xb, mask, inner, nch, out):
    """Per-channel max of ``xb & mask`` (abs-max on float bit patterns) into int64 ``out``.

    ``xb`` is the int32 (fp32) or int16 (fp16/bf16) view of the data; masking off the sign
    leaves a non-negative value of the same width, so the running max stays in 32/16-bit
    lanes (``vpand`` + ``vpmaxsd``/``vpmaxsw``) and NaN, whose bits exceed Inf's, wins.
    Short rows keep one partial max per chunk and period position, folded here.
    """
    period = inner * nch
    if nch > 1 and inner < VEC_INNER:
        length = period * -(-VEC_MIN // period)
        nck = _nchunks(xb.size)
        if nck * length <= _ABSMAX_PART_MAX:
            part = np.zeros((nck, length), dtype=xb.dtype)
            _absmax_periodic(xb, mask, part)
            red = part.max(axis=0).reshape(-1, nch, inner).max(axis=(0, 2))
            out[:nch] = red
            return
    _absmax_rows(xb, mask, inner, nch, _nchunks(xb.size), out)


@_jit(parallel=True)
def _sum_squares(x, nck, out):
    n = x.size
    part = np.zeros(nck, dtype=np.float64)
    for k in prange(nck):
        i, end = _bounds(n, nck, k)
        part[k] = _sum_squares_run(x, i, end)
    out[0] = part.sum()


@njit
def _sum_squares_run(x, start, stop):
    """Sum of x[start:stop]² in float64 over 8 running sums (independent adds vectorise;
    one running sum would wait on each add), on a slice from index 0 (see ``layout.py``)."""
    v = x[start:stop]
    lanes = np.zeros(8, dtype=np.float64)
    body = v.size // 8 * 8
    for j in range(0, body, 8):
        for u in range(8):
            d = np.float64(v[j + u])
            lanes[u] += d * d
    acc = lanes.sum()
    for j in range(body, v.size):
        d = np.float64(v[j])
        acc += d * d
    return acc


def sum_squares(x, out):
    """Sum of x² in float64 into ``out[0]``."""
    _sum_squares(x, _nchunks(x.size), out)
