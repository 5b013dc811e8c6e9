"""CPU kernels: ``@njit(parallel=True)`` over contiguous NumPy arrays.

Every kernel works on a flat array viewed as rows: element ``i`` belongs to channel
``(i // inner) % nch`` (per tensor: ``inner = n``, ``nch = 1``). Work is split into a few
contiguous chunks per thread; each chunk walks the row segments it covers, so the innermost
loop has one scale and no index arithmetic and vectorises. Float32 values are read as
``uint32`` bit views where the bits matter (abs-max, float formats). Nothing here allocates
outputs except small partial-result arrays; the dispatcher passes preallocated outputs.
Numerics follow ``reference.py`` exactly (no fastmath: nothing here would gain from it
without changing a rounding or NaN result). Hot loops were checked in the assembly: abs-max
is ``vpand``/``vpmaxsd`` on 32-bit lanes, dequantize ``vpmovsxbd``/``vcvtdq2ps``/``vmulps``,
RNE quantize ``vdivps``/``vroundps``/``vcvttps2dq``, the float casts blend-based.

Threading: Numba's default layer is used (``omp`` here; ``workqueue`` measured the same on
these memory-bound loops, ``tbb`` is not installed) and nothing is set at import, since a
threading layer is process-wide and other Numba code may depend on it.
"""

import functools

import numba
import numpy as np
from numba import njit, prange

from . import floatfmt, rng

_ff = floatfmt.build(njit)
ff_encode = _ff.encode
ff_round = _ff.round_bits
rng_bits = njit(rng.rng_bits)

_MIN_CHUNK = 1 << 15
_UNIT24 = np.float32(2.0**-24)


@njit
def _nchunks(n):
    return max(1, min(n // _MIN_CHUNK, 4 * numba.get_num_threads()))


@njit
def _bounds(n, nchunks, k):
    return (k * n) // nchunks, ((k + 1) * n) // nchunks


@njit
def _segment(i, end, inner, nch):
    """Return (channel, stop) of the row segment that starts at flat index i."""
    row = i // inner
    return row % nch, min(end, (row + 1) * inner)


@njit(parallel=True)
def absmax_bits(xb, mask, inner, nch, out):
    """Per-channel max of ``xb & mask`` (abs-max on float bit patterns) into int64 ``out``.

    ``xb`` is the int32 (fp32) or int16 (fp16/bf16) view of the data; masking off the sign
    leaves a non-negative value of the same width, so the running max stays in 32/16-bit
    lanes (``vpand`` + ``vpmaxsd``/``vpmaxsw``) and NaN, whose bits exceed Inf's, wins.
    """
    n = xb.size
    nck = _nchunks(n)
    part = np.zeros((nck, nch), dtype=np.int64)
    m0 = xb.dtype.type(mask)
    for k in prange(nck):
        i, end = _bounds(n, nck, k)
        while i < end:
            c, stop = _segment(i, end, inner, nch)
            m = xb.dtype.type(0)
            for j in range(i, stop):
                m = max(m, xb.dtype.type(xb[j] & m0))
            part[k, c] = max(part[k, c], np.int64(m))
            i = stop
    for c in range(nch):
        out[c] = 0
    for k in range(nck):
        for c in range(nch):
            out[c] = max(out[c], part[k, c])


@njit(parallel=True)
def quantize(x, scales, inner, nch, qmax, stochastic, key, out):
    """int8 codes of float32 ``x``: RNE ``rint(x/s)`` or stochastic, clamped to ±qmax.

    Returns the largest ``|x|`` bit pattern seen (an int), so a caller that has no abs-max
    pass of its own can check for NaN/Inf (``>= 0x7F800000``) without reading x again.
    """
    n = x.size
    nck = _nchunks(n)
    hi = np.float32(qmax)
    lo = -hi
    xi = x.view(np.int32)
    part = np.zeros(nck, dtype=np.int64)
    for k in prange(nck):
        i, end = _bounds(n, nck, k)
        m = np.int32(0)
        while i < end:
            c, stop = _segment(i, end, inner, nch)
            s = scales[c]
            div = s if s > 0 else np.float32(1)
            if stochastic:
                for j in range(i, stop):
                    v = x[j] / div
                    f = np.floor(v)
                    u = np.float32(rng_bits(key, j) >> 8) * _UNIT24
                    q = f + np.float32(1) if u < v - f else f
                    out[j] = np.int8(min(max(q, lo), hi))
                    m = max(m, np.int32(xi[j] & 0x7FFFFFFF))
            else:
                for j in range(i, stop):
                    out[j] = np.int8(min(max(np.rint(x[j] / div), lo), hi))
                    m = max(m, np.int32(xi[j] & 0x7FFFFFFF))
            i = stop
        part[k] = m
    return part.max()


@njit(parallel=True)
def dequantize(q, scales, inner, nch, out):
    """``q * s`` in float32."""
    n = q.size
    nck = _nchunks(n)
    for k in prange(nck):
        i, end = _bounds(n, nck, k)
        while i < end:
            c, stop = _segment(i, end, inner, nch)
            s = scales[c]
            for j in range(i, stop):
                out[j] = np.float32(q[j]) * s
            i = stop


@njit(parallel=True)
def fake_quantize(x, scales, inner, nch, stochastic, key, out_fmt, out, sse_out):
    """Quantize, dequantize, round to ``out_fmt``; float64 sum of squared error to sse_out[0]."""
    n = x.size
    nck = _nchunks(n)
    sse = np.zeros(nck, dtype=np.float64)
    reround = out_fmt[1] < 23
    for k in prange(nck):
        i, end = _bounds(n, nck, k)
        acc = 0.0
        while i < end:
            c, stop = _segment(i, end, inner, nch)
            s = scales[c]
            div = s if s > 0 else np.float32(1)
            for j in range(i, stop):
                v = x[j] / div
                if stochastic:
                    f = np.floor(v)
                    u = np.float32(rng_bits(key, j) >> 8) * _UNIT24
                    q = f + np.float32(1) if u < v - f else f
                else:
                    q = np.rint(v)
                y = min(max(q, np.float32(-127)), np.float32(127)) * s
                if reround:
                    y = np.uint32(ff_round(np.float32(y).view(np.uint32), out_fmt)).view(np.float32)
                out[j] = y
                d = np.float64(y) - np.float64(x[j])
                acc += d * d
            i = stop
        sse[k] = acc
    sse_out[0] = sse.sum()


# Float formats. The scalar source is ``floatfmt`` (shared with the CUDA kernels). With the
# format a run-time tuple, Numba's 64-bit integer typing keeps the vector lanes 64 bits wide;
# with the format a compile-time constant, LLVM folds the constants and narrows the hot loop
# to 32-bit lanes (about twice the throughput). So large arrays get a kernel compiled for
# their format (once per format and kernel, cached), small ones the generic kernel.
SPECIALIZE_MIN = 1 << 18


@njit(parallel=True)
def _float_encode(xb, fmt, out):
    for j in prange(xb.size):
        out[j] = ff_encode(xb[j], fmt)


@njit(parallel=True)
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

    @njit(parallel=True)
    def kernel(xb, out):
        for j in prange(xb.size):
            out[j] = ff_encode(xb[j], F)

    return kernel


@functools.cache
def _round_for(fmt, prescale):
    F = tuple(int(v) for v in fmt)

    if prescale:
        @njit(parallel=True)
        def kernel(x, p1, p2, out):
            p1 = np.float32(p1)
            p2 = np.float32(p2)
            for j in prange(x.size):
                out[j] = ff_round(np.float32(x[j] * p1 * p2).view(np.uint32), F)
    else:
        @njit(parallel=True)
        def kernel(x, p1, p2, out):
            xb = x.view(np.uint32)
            for j in prange(x.size):
                out[j] = ff_round(xb[j], F)

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


@njit(parallel=True)
def sum_squares(x, out):
    """Sum of x² in float64 into ``out[0]``."""
    n = x.size
    nck = _nchunks(n)
    part = np.zeros(nck, dtype=np.float64)
    for k in prange(nck):
        i, end = _bounds(n, nck, k)
        acc = 0.0
        for j in range(i, end):
            d = np.float64(x[j])
            acc += d * d
        part[k] = acc
    out[0] = part.sum()


@njit(parallel=True)
def exp_dither_encode(x, m, key, out):
    """Global-QSGD exponential dithering codes (see ``reference.exp_dither_encode``)."""
    m = np.float32(m)
    div = m if m > 0 else np.float32(1)
    xbits = x.view(np.uint32)
    for j in prange(x.size):
        xb = xbits[j]
        r = np.float32(abs(x[j]) / div)
        rb = np.int64(r.view(np.uint32))
        eb = rb >> 23
        up = (rng_bits(key, j) >> 8) < 2 * (rb & 0x7FFFFF)
        if eb >= 127:
            code = 1
        elif eb >= 1:
            code = 128 - eb - (1 if up else 0)
        else:
            code = 127 if up else 0
        if m <= 0:
            code = 0
        if code > 0 and (xb >> 31) != 0:
            code = code | 0x80
        out[j] = code


@njit(parallel=True)
def exp_dither_decode(codes, m, out):
    """``±M · 2**-(c-1)`` from exponential-dithering codes."""
    m = np.float32(m)
    for j in prange(codes.size):
        c = np.int64(codes[j])
        k = (c & 0x7F) - 1
        val = np.float32(0)
        if k >= 0:
            val = m * np.uint32(max(127 - k, 1) << 23).view(np.float32)
        out[j] = -val if c & 0x80 else val


@njit(parallel=True)
def cgx_meta(x, bucket, levels, meta):
    """Per group: ``meta[g] = (min, float32((max - min) / levels))``."""
    n = x.size
    for g in prange(meta.shape[0]):
        start = g * bucket
        stop = min(n, start + bucket)
        mn = x[start]
        mx = x[start]
        for j in range(start + 1, stop):
            mn = min(mn, x[j])
            mx = max(mx, x[j])
        meta[g, 0] = mn
        meta[g, 1] = np.float32((np.float64(mx) - np.float64(mn)) / levels)


@njit
def _cgx_code(x, j, meta, bucket, levels, stochastic, key):
    g = j // bucket
    unit = np.float64(meta[g, 1])
    if unit <= 0:
        return 0
    v = (np.float64(x[j]) - np.float64(meta[g, 0])) / unit
    r = 0.5
    if stochastic:
        r = np.float64(rng_bits(key, j) >> 8) * 2.0**-24
    return min(max(np.int64(np.floor(v + r)), 0), levels)


@njit(parallel=True)
def cgx_encode(x, meta, bucket, bits, stochastic, key, payload):
    """Quantize groups to b bits and pack 8 codes into b bytes, little-endian."""
    n = x.size
    levels = (1 << bits) - 1
    for blk in prange(payload.size // bits):
        acc = np.int64(0)
        for t in range(8):
            j = blk * 8 + t
            if j < n:
                acc |= _cgx_code(x, j, meta, bucket, levels, stochastic, key) << (t * bits)
        for t in range(bits):
            payload[blk * bits + t] = (acc >> (8 * t)) & 0xFF


@njit(parallel=True)
def cgx_decode(payload, meta, bucket, bits, out):
    """Unpack b-bit codes and return ``min + unit·q`` (float64 arithmetic, float32 out)."""
    n = out.size
    mask = (1 << bits) - 1
    for blk in prange(payload.size // bits):
        acc = np.int64(0)
        for t in range(bits):
            acc |= np.int64(payload[blk * bits + t]) << (8 * t)
        for t in range(8):
            j = blk * 8 + t
            if j < n:
                g = j // bucket
                q = (acc >> (t * bits)) & mask
                out[j] = np.float32(np.float64(meta[g, 0]) + np.float64(meta[g, 1]) * q)
