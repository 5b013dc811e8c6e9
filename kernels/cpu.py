"""CPU kernels: ``@njit(parallel=True)`` over contiguous NumPy arrays.

Layout. Every kernel works on a flat array whose element ``i`` belongs to channel
``(i // inner) % nch`` (per tensor: ``inner = n``, ``nch = 1``). Two loop shapes:

* long rows (per tensor, or ``inner >= VEC_INNER``): the array is split into a few contiguous
  chunks per thread; a chunk walks the row segments it covers, each with one scale;
* short rows (per channel along the last axis or axes, ``inner < VEC_INNER``): the scale is
  periodic in ``i`` with period ``P = nch * inner``, so a *period vector* (the scale of every
  position of one period, tiled to at least ``VEC_MIN`` elements; just ``scales`` when
  ``inner == 1``) is read beside the data, and each chunk walks whole periods.

Either way the innermost loop runs over array *slices* from index 0, with a scalar scale or a
slice of the period vector (``_at``): Numba's negative-index wrap-around then folds away and
LLVM vectorises the loop with contiguous loads and stores. (With ``for j in range(i, stop)``
over the full arrays it cannot prove ``j >= 0``: every load becomes a gather and every
int8 store a ``vpextrb`` scatter, and the loop runs far below memory bandwidth.)

Float32 values are read as ``uint32``/``int32`` bit views where the bits matter (abs-max, float
formats). Nothing here allocates outputs except small partial-result arrays and period
vectors; the Python wrappers pass preallocated outputs. Numerics follow ``reference.py`` exactly
(no fastmath): quantize keeps the true division ``x / s`` (a reciprocal multiply changes the
rounding of some quotients, e.g. ties of ``rint``; the division is not the bottleneck here:
``vdivps`` retires 8 quotients every few cycles, far above what memory delivers). The hot
loops compile to packed instructions: abs-max ``vpand``/``vpmaxsd``, dequantize
``vpmovsxbd``/``vcvtdq2ps``/``vmulps``, RNE quantize ``vdivps``/``vroundps``/``vcvttps2dq``
with packed stores, the float casts blend-based in 32-bit lanes, stochastic rounding's hash in
32-bit lanes (``rng_bits32``).

Compilation: kernels are compiled on first use and cached on disk (``cache=True``; Numba
puts the cache in ``__pycache__`` beside this file, or in its user-wide cache directory when
that is read-only; with no writable place at all they are compiled per process).
The cache key also holds a digest of ``floatfmt.py`` and ``rng.py``, whose functions the
kernels inline (Numba itself only watches this file). So the first calls compile (slow,
once per install), and later processes load the compiled kernels from the cache.

Threading: Numba's default layer is used (these loops are memory-bound, so the choice of
layer matters little) and nothing is set at import, since a threading layer is process-wide
and other Numba code may depend on it.
"""

import functools
import hashlib

import numba
import numpy as np
from numba import njit, prange
from numba.core import types
from numba.extending import overload

from . import floatfmt, rng


def _sources_digest(*modules):
    """sha256 of the modules' source files (None when one cannot be read)."""
    h = hashlib.sha256()
    try:
        for m in modules:
            with open(m.__file__, "rb") as f:
                h.update(f.read())
    except (OSError, AttributeError, TypeError):
        return None
    return h.hexdigest()


# Numba invalidates a disk-cached kernel when *this* file changes, not when a function it
# calls from another module does; the kernels inline floatfmt's and rng's functions, so their
# sources' digest is added to every cache key (below).
_DEPS_DIGEST = _sources_digest(floatfmt, rng)


def _jit(**options):
    """``njit(cache=True, **options)``, keyed also on ``_DEPS_DIGEST``; plain ``njit`` where
    Numba has nowhere to write a cache (read-only install and home) or its cache internals
    are not the ones known here (then compiling per process is the safe choice)."""

    def decorate(fn):
        if _DEPS_DIGEST is None:
            return njit(**options)(fn)
        try:
            disp = njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available for file ..."
            return njit(**options)(fn)
        if getattr(getattr(disp, "_cache", None), "_index_key", None) is None:
            return njit(**options)(fn)
        disp._cache._index_key = lambda sig, codegen: (
            sig, codegen.magic_tuple(), _function_digest(fn), _DEPS_DIGEST)
        return disp

    return decorate


_PLAIN = (type(None), bool, int, float, str, np.generic, np.dtype)


def _function_digest(fn) -> str:
    """sha256 of ``fn``'s code and, recursively, of what its closure holds.

    It replaces the code-and-closure part of Numba's cache key, which pickles the closure:
    a jitted function pickles with an id drawn anew in every process, so a kernel that
    closes over another (a ``*_for(fmt)`` factory's) missed the cache in every process
    and was compiled again (seconds per process, and one more cache entry each time).
    Plain values (format tuples, flags) go in by ``repr``; anything else by Numba's own
    pickle (a miss at worst, never a wrong hit).
    """
    h = hashlib.sha256(_code_digest(fn.__code__).encode())
    for cell in fn.__closure__ or ():
        h.update(_value_digest(cell.cell_contents).encode())
    return h.hexdigest()


def _code_digest(code) -> str:
    """sha256 of a code object's bytecode, names and constants (nested code by digest:
    its ``repr`` holds an address)."""
    consts = [_code_digest(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts]
    return hashlib.sha256(repr((code.co_code, code.co_names, consts)).encode()).hexdigest()


def _value_digest(value) -> str:
    inner = getattr(value, "py_func", None)
    if inner is not None:
        return "fn:" + _function_digest(inner)
    if isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value) or \
            isinstance(value, _PLAIN):
        return "v:" + repr(value)
    from numba.core.serialize import dumps

    return "p:" + hashlib.sha256(dumps(value)).hexdigest()


_ff = floatfmt.build(njit)
ff_encode = _ff.encode
ff_round = _ff.round_bits
ff_encode_narrow = _ff.encode_narrow
ff_round_narrow = _ff.round_narrow
ff_round_wide = _ff.round_wide
ff_cast_value = _ff.cast_value
ff_widen = _ff.widen
exp_dither_code = _ff.exp_dither_code
exp_dither_value = _ff.exp_dither_value
rng_bits = njit(rng.rng_bits)

_MIN_CHUNK = 1 << 15
_UNIT24 = np.float32(2.0**-24)
_UNIT16 = np.float32(2.0**-16)
VEC_INNER = 256  # rows shorter than this use a period vector of scales
VEC_MIN = 1024  # a period vector is tiled to at least this many elements
VEC_PERIOD_MAX = 1 << 20  # largest period materialised (when inner > 1)
_ABSMAX_PART_MAX = 1 << 21  # largest (chunks x period) partial-max array of a periodic abs-max
_MUL_A = np.uint32(rng.MUL_A)
_MUL_B = np.uint32(rng.MUL_B)
_U32 = np.uint32(0xFFFFFFFF)


# ----------------------------------------------------------------------------- helpers


@njit
def _mix32(h):
    h = np.uint32(h ^ (h >> np.uint32(16)))
    h = np.uint32(h * _MUL_A)
    h = np.uint32(h ^ (h >> np.uint32(15)))
    h = np.uint32(h * _MUL_B)
    return np.uint32(h ^ (h >> np.uint32(16)))


@njit
def _hash32(key, lo, hi):
    h = _mix32(np.uint32(np.uint32(key & _U32) ^ lo))
    return _mix32(np.uint32(h ^ hi))


@njit
def rng_bits32(key, index):
    """``rng.rng_bits(key, index)`` as a uint32, computed in 32-bit lanes.

    ``rng.rng_bits`` keeps every product below 2**49 (split 16-bit multiplies, masked to 32
    bits) so that it is exact in any integer type; the result is the 32-bit wrap-around
    product, which is what ``uint32 * uint32`` truncated to 32 bits gives directly
    (``vpmulld``).
    """
    return _hash32(key, np.uint32(index & _U32), np.uint32((index >> 32) & _U32))


@njit
def _uniform(key, lo, hi):
    """Uniform float32 in [0, 1) of element ``hi * 2**32 + lo``: ``(rng_bits >> 8) * 2**-24``.

    Runs never cross a multiple of 2**32 (``_no_wrap``), so a loop passes ``uint32(j)`` and
    the run's constant high word, and the index stays in 32-bit lanes too.
    """
    return np.float32(np.int32(_hash32(key, lo, hi) >> np.uint32(8))) * _UNIT24


@njit
def _pair_uniforms(h):
    """The two uniform float32 numbers in [0, 1) of a pair hash: ``(low 16 bits, high 16 bits)
    * 2**-16`` (see ``rng.py``)."""
    return (np.float32(np.int32(h & np.uint32(0xFFFF))) * _UNIT16,
            np.float32(np.int32(h >> np.uint32(16))) * _UNIT16)


def _at(v, t):
    """``v[t]`` for an array (period vector), ``v`` itself for a scalar scale."""
    return v[t] if isinstance(v, np.ndarray) else v


@overload(_at)
def _at_overload(v, t):
    if isinstance(v, types.Array):
        return lambda v, t: v[t]
    return lambda v, t: v


def _part(v, a, b):
    """``v[a:b]`` for an array (period vector), ``v`` itself for a scalar scale."""
    return v[a:b] if isinstance(v, np.ndarray) else v


@overload(_part)
def _part_overload(v, a, b):
    if isinstance(v, types.Array):
        return lambda v, a, b: v[a:b]
    return lambda v, a, b: v


def _nchunks(n):
    """Chunks for n elements: a few per thread, none under ``_MIN_CHUNK`` elements.

    Computed here, not in the kernels: ``numba.get_num_threads()`` inside a kernel goes
    through a ctypes pointer, which would keep Numba from caching the kernel on disk.
    """
    return max(1, min(n // _MIN_CHUNK, 4 * numba.get_num_threads()))


@njit
def _bounds(n, nchunks, k):
    return (k * n) // nchunks, ((k + 1) * n) // nchunks


@njit
def _no_wrap(i, stop):
    """``stop``, or the next multiple of 2**32 after ``i`` when that comes first."""
    return min(stop, ((i >> 32) + 1) << 32)


@njit
def _segment(i, end, inner, nch):
    """Return (channel, stop) of the row segment that starts at flat index i."""
    row = i // inner
    return row % nch, _no_wrap(i, min(end, (row + 1) * inner))


@njit
def _period_stop(i, end, period):
    """Return (position in the period vector, stop) of the run that starts at flat index i."""
    p = i % period
    return p, _no_wrap(i, min(end, i + period - p))


_NOVEC = np.zeros(0, dtype=np.float32)


def _period_vector(values, inner, nch):
    """The period vector of per-channel ``values`` (float32), or None for long rows.

    Position ``p`` of the result holds ``values[(p // inner) % nch]``; its length is a multiple
    of ``nch * inner``, at least ``VEC_MIN``.
    """
    period = inner * nch
    if nch == 1 or inner >= VEC_INNER or (inner > 1 and period > VEC_PERIOD_MAX):
        return None
    v = np.ascontiguousarray(values, dtype=np.float32)
    if inner > 1:
        v = np.repeat(v, inner)
    if period < VEC_MIN:
        v = np.tile(v, -(-VEC_MIN // period))
    return v


def _divisors(v):
    """Divisors of quantize: the scale, or 1 where it is 0 (all-zero channels get code 0)."""
    return np.where(v > 0, v, np.float32(1)).astype(np.float32)


# ----------------------------------------------------------------------------- abs-max


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


# ----------------------------------------------------------------------------- int8


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


# ----------------------------------------------------------------------------- float formats

# The scalar source is ``floatfmt`` (shared with the CUDA kernels). With the format a run-time
# tuple, Numba's 64-bit integer typing keeps the vector lanes 64 bits wide; with the format a
# compile-time constant, LLVM folds the constants and narrows the hot loop to 32-bit lanes
# (twice the lanes per vector). So large arrays get a kernel compiled for their format (once
# per format and kernel, cached in memory and on disk: the closure's format is part of
# Numba's cache key), small ones the generic kernel. Formats with 2 <= E <= 7 and
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
    encode = ff_encode_narrow if floatfmt.is_narrow(F) else ff_encode

    @_jit(parallel=True)
    def kernel(xb, out):
        for j in prange(xb.size):
            out[j] = encode(xb[j], F)

    return kernel


def _round_fn(fmt):
    """The fastest of ``floatfmt``'s equivalent rounding functions for ``fmt``."""
    if floatfmt.is_narrow(fmt):
        return ff_round_narrow
    return ff_round_wide if floatfmt.is_wide(fmt) else ff_round


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


_SUM_BLOCK = 4096  # floats of a sum kept in L1 while every row is added to them


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


@_jit(parallel=True, error_model="numpy")
def _float_quantize(x, scales, fmt, codes, values):
    s = scales[0]
    for j in prange(x.size):
        b = np.float32(x[j] / s).view(np.uint32)
        c = ff_encode(b, fmt)
        codes[j] = c
        values[j] = ff_cast_value(b, c, ff_round(b, fmt), fmt)


@functools.cache
def _quantize_float_for(fmt):
    F = tuple(int(v) for v in fmt)
    encode = ff_encode_narrow if floatfmt.is_narrow(F) else ff_encode
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


@functools.cache
def _encode_scaled_for(fmt):
    F = tuple(int(v) for v in fmt)
    encode = ff_encode_narrow if floatfmt.is_narrow(F) else ff_encode

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


def float_quantize(x, scales, fmt, codes, values):
    """Codes of float32 ``x / scales[0]`` in ``fmt`` (uint8 or uint16) and the float32 bits
    of their values (uint32 ``values``), in one pass: the rounding shares the encoding's
    arithmetic."""
    if x.size >= SPECIALIZE_MIN:
        _quantize_float_for(tuple(fmt))(x, scales, codes, values)
    else:
        _float_quantize(x, scales, tuple(fmt), codes, values)


# ----------------------------------------------------------------------------- compression


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
    one running sum would wait on each add), on a slice from index 0 (see the layout note)."""
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


@_jit(parallel=True, error_model="numpy")
def exp_dither_encode(x, m, key, out):
    """Global-QSGD exponential dithering codes (``floatfmt.exp_dither_code``)."""
    m = np.float32(m)
    div = m if m > 0 else np.float32(1)
    for j in prange(x.size):
        out[j] = exp_dither_code(x[j], div, m, rng_bits32(key, j))


@_jit(parallel=True)
def exp_dither_decode(codes, m, out):
    """``±M · 2**-(c-1)`` from exponential-dithering codes."""
    m = np.float32(m)
    for j in prange(codes.size):
        out[j] = exp_dither_value(codes[j], m)


@_jit(parallel=True)
def cgx_meta(x, bucket, levels, meta):
    """Per group: ``meta[g] = (min, float32((max - min) / levels))``; a group holding NaN
    or Inf gets a non-finite meta."""
    n = x.size
    for g in prange(meta.shape[0]):
        start = g * bucket
        _cgx_group_meta(x[start:min(n, start + bucket)], levels, meta[g])


@njit
def _cgx_group_meta(group, levels, meta):
    lo, hi = _min_max(group)
    meta[0] = lo
    meta[1] = np.float32((np.float64(hi) - np.float64(lo)) / levels)


@njit(error_model="numpy")
def _cgx_code(x, lo, inv, levels, stochastic, key, j):
    """One CGX code: ``floor((x - lo)·inv + r)`` clamped to [0, levels] (float32)."""
    r = np.float32(0.5)
    if stochastic:
        pair = j >> 1
        r = _pair_uniforms(_hash32(key, np.uint32(pair & _U32), np.uint32(pair >> 32)))[j & 1]
    return np.uint64(_cgx_clamp(np.floor((x - lo) * inv + r), levels))


@njit
def _cgx_clamp(v, levels):
    """A code ``v`` (float32) clamped to [0, levels] (still a float32)."""
    return min(max(v, np.float32(0)), np.float32(levels))


@njit
def _cgx_inverse(unit):
    """``1 / unit`` in float32 (0 for a constant group: every code is 0)."""
    return np.float32(1) / unit if unit > 0 else np.float32(0)


@_jit(parallel=True, error_model="numpy")
def _cgx_encode(x, meta, bucket, bits, stochastic, key, payload, with_meta, error, nck):
    """Quantize groups to b bits and pack 8 codes into b bytes, little-endian (first scanning
    each group for its min and max when ``with_meta``: one read of ``x``; with a non-empty
    ``error``, each group's ``x - (min + unit·q)`` is written there while it is in cache).

    Groups of a multiple of 8 elements run in ``nck`` parallel chunks of whole groups. A
    group's codes (float32 arithmetic, a vectorised loop over pairs) go straight into the
    payload for 4 bits (two a byte) and 8 bits; for other widths into a scratch buffer per
    chunk, then 8 at a time into one 64-bit word whose ``bits`` low bytes are stored. Other
    group sizes are coded block by block.
    """
    n = x.size
    levels = (1 << bits) - 1
    if bucket % 8:  # blocks straddle groups: code by code
        for blk in prange(payload.size // bits):
            acc = np.uint64(0)
            for t in range(8):
                j = blk * 8 + t
                if j < n:
                    g = j // bucket
                    acc |= _cgx_code(x[j], meta[g, 0], _cgx_inverse(meta[g, 1]), levels,
                                     stochastic, key, j) << np.uint64(t * bits)
            for t in range(bits):
                payload[blk * bits + t] = np.uint8((acc >> np.uint64(8 * t)) & np.uint64(0xFF))
        return
    groups = meta.shape[0]
    for k in prange(nck):
        codes = np.empty(0 if bits == 4 or bits == 8 else bucket, dtype=np.uint8)  # to pack
        unpacked = np.empty(bucket if error.size and bits != 8 else 0, dtype=np.uint8)
        first, stop = _bounds(groups, nck, k)
        for g in range(first, stop):
            start = g * bucket
            size = min(bucket, n - start)
            group = x[start:start + size]
            if with_meta:
                _cgx_group_meta(group, levels, meta[g])
            lo, inv = meta[g, 0], _cgx_inverse(meta[g, 1])
            block = payload[start // 8 * bits:(start + bucket) // 8 * bits]
            if bits == 4 or bits == 8:  # the codes go straight into the payload
                _cgx_group_codes(group, lo, inv, levels, stochastic, key, start, block, bits == 4)
                block[(size * bits + 7) // 8:] = 0
            else:
                _cgx_group_codes(group, lo, inv, levels, stochastic, key, start, codes, False)
                codes[size:] = 0
                _cgx_pack(codes, bits, block)
            if error.size:
                part = error[start:start + size]
                if bits == 8:
                    _cgx_error(group, block, lo, meta[g, 1], part)
                else:
                    _cgx_unpack(block, bits, unpacked)
                    _cgx_error(group, unpacked, lo, meta[g, 1], part)


def _group_chunks(groups, n):
    """Parallel chunks of whole groups: as many as :func:`_nchunks` gives ``n`` elements."""
    return max(1, min(groups, _nchunks(n)))


def cgx_encode(x, meta, bucket, bits, stochastic, key, payload):
    """CGX codes of ``x`` by the given ``(min, unit)`` per group, packed into ``payload``."""
    _cgx_encode(x, meta, bucket, bits, stochastic, key, payload, False, _NO_ERROR,
                _group_chunks(meta.shape[0], x.size))


def cgx_meta_encode(x, bucket, bits, stochastic, key, meta, payload, error=None):
    """:func:`cgx_meta` and :func:`cgx_encode` in one read of ``x`` (``bucket`` a multiple of
    8): each group is scanned for its min and max, then coded from the cache, and its
    compression error ``x - (min + unit·q)`` (float32, as :func:`cgx_decode` computes the
    value) written into ``error`` where given. A group holding NaN or Inf gets a non-finite
    meta (the caller checks ``meta``)."""
    _cgx_encode(x, meta, bucket, bits, stochastic, key, payload, True,
                _NO_ERROR if error is None else error, _group_chunks(meta.shape[0], x.size))


_NO_ERROR = np.empty(0, dtype=np.float32)


@njit(error_model="numpy")
def _cgx_error(x, codes, lo, unit, error):
    """``x - (lo + unit·q)`` of a group's codes (float32)."""
    for t in range(error.size):
        error[t] = x[t] - (lo + unit * np.float32(codes[t]))


@njit
def _min_max(x):
    """Min and max, on the bits: a float32's bits with the magnitude bits flipped for
    negatives order like the values (signed int32), and integer min/max vectorise where
    float min/max do not. In that order +Inf and every positive NaN come at or above +Inf,
    -Inf and every negative NaN at or below -Inf, so a group holding any of them has a
    non-finite min or max."""
    bits = x.view(np.int32)
    lo = np.int32(0x7FFFFFFF)
    hi = np.int32(-0x80000000)
    for t in range(x.size):  # int32 constants throughout: an int64 one widens the lanes
        b = bits[t]
        key = np.int32(b ^ np.int32(np.int32(b >> np.int32(31)) & np.int32(0x7FFFFFFF)))
        lo = min(lo, key)
        hi = max(hi, key)
    return _ordered_float(lo), _ordered_float(hi)


@njit
def _ordered_float(key):
    """The float32 whose ordered bits (see :func:`_min_max`) are ``key``."""
    return np.int32(key ^ ((key >> 31) & np.int32(0x7FFFFFFF))).view(np.float32)


@njit(error_model="numpy")
def _cgx_group_codes(x, lo, inv, levels, stochastic, key, start, out, two_per_byte):
    """The codes of one group (``start``: its first element's index, even) into ``out``, one
    per byte or two (``two_per_byte``: the first in the low 4 bits). The loop is split where
    the index crosses a multiple of 2**33, where the pair index's high word changes (the
    hash takes it per run, see ``rng.py``)."""
    split = min(x.size, (((start >> 33) + 1) << 33) - start)
    _cgx_run(x[:split], lo, inv, levels, stochastic, key, start, out, two_per_byte)
    at = split // 2 if two_per_byte else split
    _cgx_run(x[split:], lo, inv, levels, stochastic, key, start + split, out[at:], two_per_byte)


@njit(error_model="numpy")
def _cgx_run(x, lo, inv, levels, stochastic, key, j0, out, two_per_byte):
    """Codes of elements ``j0..`` (``j0`` even, no multiple of 2**33 crossed): one hash of
    the pair index per two codes, its words in 32-bit lanes (the low word counted in a
    uint32 of its own: from the 64-bit loop index the lanes would be narrowed every step)."""
    high = np.uint32(j0 >> 33)
    word = np.uint32((j0 >> 1) & 0xFFFFFFFF)
    pairs = x.size // 2
    if two_per_byte:
        for p in range(pairs):
            c0, c1 = _cgx_pair(x, p, lo, inv, levels, stochastic, key, word, high)
            out[p] = np.uint8(np.int32(c0 + np.float32(16) * c1))  # one conversion a byte
            word = np.uint32(word + np.uint32(1))
    else:
        for p in range(pairs):
            c0, c1 = _cgx_pair(x, p, lo, inv, levels, stochastic, key, word, high)
            out[2 * p] = np.uint8(c0)
            out[2 * p + 1] = np.uint8(c1)
            word = np.uint32(word + np.uint32(1))
    if x.size % 2:
        c = np.uint8(_cgx_code(x[-1], lo, inv, levels, stochastic, key, j0 + x.size - 1))
        out[pairs if two_per_byte else x.size - 1] = c


@njit(error_model="numpy")
def _cgx_pair(x, p, lo, inv, levels, stochastic, key, word, high):
    """The codes of ``x[2p]`` and ``x[2p + 1]`` as float32 (``word``: the pair index's low
    word)."""
    u0, u1 = (_pair_uniforms(_hash32(key, word, high))
              if stochastic else (np.float32(0.5), np.float32(0.5)))
    return (_cgx_clamp(np.floor((x[2 * p] - lo) * inv + u0), levels),
            _cgx_clamp(np.floor((x[2 * p + 1] - lo) * inv + u1), levels))


@njit
def _cgx_pack(codes, bits, payload):
    """Pack ``codes`` (a multiple of 8) 8 to ``bits`` bytes, little-endian (the 4- and 8-bit
    codes are written packed by :func:`_cgx_run`)."""
    for blk in range(min(codes.size // 8, payload.size // bits)):
        acc = np.uint64(0)
        for t in range(8):
            acc |= np.uint64(codes[blk * 8 + t]) << np.uint64(t * bits)
        for t in range(bits):
            payload[blk * bits + t] = np.uint8((acc >> np.uint64(8 * t)) & np.uint64(0xFF))


@_jit(parallel=True, error_model="numpy")
def _cgx_decode(payload, meta, bucket, bits, accumulate, out, nck):
    n = out.size
    mask = np.uint64((1 << bits) - 1)
    if bucket % 8:  # blocks straddle groups: code by code
        for blk in prange(payload.size // bits):
            acc = _cgx_word(payload, blk, bits)
            base = blk * 8
            for t in range(min(8, n - base)):
                g = (base + t) // bucket
                value = meta[g, 0] + meta[g, 1] * np.float32((acc >> np.uint64(t * bits)) & mask)
                out[base + t] = out[base + t] + value if accumulate else value
        return
    groups = meta.shape[0]
    for k in prange(nck):
        codes = np.empty(bucket, dtype=np.uint8)
        first, stop = _bounds(groups, nck, k)
        for g in range(first, stop):
            start = g * bucket
            size = min(bucket, n - start)
            block = payload[start // 8 * bits:(start + bucket) // 8 * bits]
            lo, unit, part = meta[g, 0], meta[g, 1], out[start:start + size]
            if bits == 8:  # the payload holds the codes themselves
                _cgx_values(block, lo, unit, accumulate, part)
            else:
                _cgx_unpack(block, bits, codes)
                _cgx_values(codes, lo, unit, accumulate, part)


def cgx_decode(payload, meta, bucket, bits, accumulate, out):
    """Unpack b-bit codes into ``min + unit·q`` (float32 arithmetic), written to ``out`` or
    added to it (``accumulate``: a sum of several ranks' payloads in one pass each)."""
    _cgx_decode(payload, meta, bucket, bits, accumulate, out,
                _group_chunks(meta.shape[0], out.size))


def cgx_decode_mean(payloads, metas, bucket, bits, out):
    """The mean of several payloads' values, ``((0 + v_0) + v_1 + ...) / count`` (float32),
    into ``out``: group by group, every payload's values are added while the group's part
    of ``out`` is in cache (one write of ``out`` in all, where a decode per payload reads
    and writes it each time)."""
    if bucket % 8:
        out[:] = 0
        for payload, meta in zip(payloads, metas):
            cgx_decode(payload, meta, bucket, bits, True, out)
        out /= np.float32(len(payloads))
        return
    _cgx_decode_mean(tuple(payloads), tuple(metas), bucket, bits, out,
                     _group_chunks(metas[0].shape[0], out.size))


@_jit(parallel=True, error_model="numpy")
def _cgx_decode_mean(payloads, metas, bucket, bits, out, nck):
    n = out.size
    count = np.float32(len(payloads))
    groups = metas[0].shape[0]
    for k in prange(nck):
        codes = np.empty(bucket, dtype=np.uint8)
        first, stop = _bounds(groups, nck, k)
        for g in range(first, stop):
            start = g * bucket
            part = out[start:min(n, start + bucket)]
            part[:] = 0
            for r in range(len(payloads)):
                block = payloads[r][start // 8 * bits:(start + bucket) // 8 * bits]
                lo, unit = metas[r][g, 0], metas[r][g, 1]
                if bits == 8:
                    _cgx_values(block, lo, unit, True, part)
                else:
                    _cgx_unpack(block, bits, codes)
                    _cgx_values(codes, lo, unit, True, part)
            for t in range(part.size):
                part[t] /= count


@njit(error_model="numpy")
def _cgx_values(codes, lo, unit, accumulate, part):
    """``lo + unit·q`` of a group's codes (float32), written to ``part`` or added to it."""
    if accumulate:
        for t in range(part.size):
            part[t] += lo + unit * np.float32(codes[t])
    else:
        for t in range(part.size):
            part[t] = lo + unit * np.float32(codes[t])


@njit
def _cgx_unpack(payload, bits, codes):
    """The inverse of :func:`_cgx_pack` (as many codes as ``payload`` holds, 1 to 7 bits)."""
    if bits == 4:
        for i in range(min(codes.size // 2, payload.size)):
            byte = payload[i]
            codes[2 * i] = byte & np.uint8(15)
            codes[2 * i + 1] = byte >> np.uint8(4)
        return
    mask = np.uint64((1 << bits) - 1)
    for blk in range(min(codes.size // 8, payload.size // bits)):
        acc = _cgx_word(payload, blk, bits)
        for t in range(8):
            codes[blk * 8 + t] = np.uint8((acc >> np.uint64(t * bits)) & mask)


@njit
def _cgx_word(payload, blk, bits):
    """Block ``blk``'s ``bits`` bytes as one little-endian 64-bit word."""
    acc = np.uint64(0)
    for t in range(bits):
        acc |= np.uint64(payload[blk * bits + t]) << np.uint64(8 * t)
    return acc