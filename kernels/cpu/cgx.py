"""CGX: bucketed max-min quantization to 1..8 bits, bit-packed 8 codes to ``bits`` bytes."""

import numpy as np
from numba import njit, prange

from .jit import _jit
from .layout import _bounds, _nchunks
from .scalar import _U32, _hash32, _pair_uniforms

_NO_ERROR = np.empty(0, dtype=np.float32)


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