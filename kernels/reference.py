"""Pure NumPy reference of every kernel: the single source of truth for the numerics.

Arrays in, arrays out, no Numba. Inputs are float32 arrays (the torch-facing API upcasts fp16 and
bf16 exactly); per-channel routines take ``axis`` and a scale with one entry per channel.
The float-format functions are written from values (float64 arithmetic, ``np.frexp``),
independently of the bit-level kernels in ``floatfmt.py`` that they check.

Numerics shared by every backend (all float32 unless said otherwise):

* INT8: ``scale = amax / 127``; codes ``clip(rint(x / scale), -qmax, qmax)`` (half to even);
  stochastic: ``v = x / scale``, ``q = floor(v) + (u < v - floor(v))`` with
  ``u = (rng_bits(key, i) >> 8) * 2**-24`` and ``i`` the element's row-major index. A zero
  scale (all-zero input, or an amax so small that amax/127 underflows) divides by 1 instead,
  so every code is 0 and nothing is NaN.
* Dequantize: ``q * scale``.
"""

import functools

import numpy as np

from . import floatfmt
from .rng import GOLDEN, MASK32, MUL_A, MUL_B

# ---------------------------------------------------------------- random numbers


def rng_bits(key, index):
    """Vectorised ``rng.rng_bits`` over an int64 array of indices."""
    idx = np.asarray(index, dtype=np.int64)
    h = np.full(idx.shape, int(key) & MASK32, dtype=np.int64)
    for r in range(2):
        h ^= (idx >> (32 * r)) & MASK32
        h ^= h >> 16
        h = (h * (MUL_A & 0xFFFF) + (((h * (MUL_A >> 16)) & 0xFFFF) << 16)) & MASK32
        h ^= h >> 15
        h = (h * (MUL_B & 0xFFFF) + (((h * (MUL_B >> 16)) & 0xFFFF) << 16)) & MASK32
        h ^= h >> 16
    return h


def pair_uniform16(seed, n):
    """CGX's uniform float32 numbers of element indices ``0..n-1``: 16 bits each, two per
    hash of the pair index ``i // 2``, the low half for the even element."""
    idx = np.arange(n, dtype=np.int64)
    h = rng_bits(rng_key(seed), idx >> 1)
    return (((h >> (16 * (idx & 1))) & 0xFFFF).astype(np.float32)
            * np.float32(2.0**-16)).astype(np.float32)


def rng_key(seed):
    """Stream key of a seed (same as ``rng.rng_key``)."""
    return int(rng_bits(GOLDEN, np.array([seed]))[0])


def uniform(seed, n):
    """Uniform float32 numbers in [0, 1) for element indices ``0..n-1``."""
    u24 = rng_bits(rng_key(seed), np.arange(n, dtype=np.int64)) >> 8
    return (u24.astype(np.float32) * np.float32(2.0**-24)).astype(np.float32)


# ---------------------------------------------------------------- helpers


def channel_view(scale, shape, axis):
    """Reshape a per-channel vector so it broadcasts along ``axis`` of ``shape``."""
    if axis is None:
        return np.float32(scale)
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return np.asarray(scale, dtype=np.float32).reshape(view)


def _reduce_axes(ndim, axis):
    return tuple(d for d in range(ndim) if d != axis)


# ---------------------------------------------------------------- abs-max


def absmax(x, axis=None):
    """Max of |x| per tensor (axis None) or per channel along ``axis``; NaN propagates.

    An empty tensor (or channel) has abs-max 0.
    """
    a = np.abs(np.asarray(x, dtype=np.float32))
    if axis is None:
        return np.float32(a.max()) if a.size else np.float32(0)
    out = np.zeros(a.shape[axis], dtype=np.float32)
    if a.size:
        out = a.max(axis=_reduce_axes(a.ndim, axis)).astype(np.float32)
    return out


def int8_scale(amax, qmax=127):
    """``amax / qmax`` in float32."""
    return (np.asarray(amax, dtype=np.float32) / np.float32(qmax)).astype(np.float32)


# ---------------------------------------------------------------- int8


def quantize(x, scale, axis=None, qmax=127, stochastic=False, seed=0):
    """Symmetric int8 codes of float32 ``x`` with ``scale`` (scalar or per channel)."""
    x = np.asarray(x, dtype=np.float32)
    s = channel_view(scale, x.shape, axis)
    div = np.where(s > 0, s, np.float32(1)).astype(np.float32)
    v = (x / div).astype(np.float32)
    if stochastic:
        f = np.floor(v)
        frac = (v - f).astype(np.float32)
        u = uniform(seed, x.size).reshape(x.shape)
        q = f + (u < frac)
    else:
        q = np.rint(v)
    return np.clip(q, -qmax, qmax).astype(np.int8)


def dequantize(q, scale, axis=None):
    """``q * scale`` in float32."""
    q = np.asarray(q)
    return (q.astype(np.float32) * channel_view(scale, q.shape, axis)).astype(np.float32)


def dequantize_sum(rows, scales, divisor=1):
    """``(((0 + q_0 s_0) + q_1 s_1) + ...) / divisor`` in float32 over the int8 ``rows``
    (each product rounded to float32)."""
    rows = np.asarray(rows)
    total = np.zeros(rows.shape[1:], dtype=np.float32)
    for q, s in zip(rows, np.asarray(scales, dtype=np.float32)):
        total += dequantize(q, s)
    return (total / np.float32(divisor)).astype(np.float32)


def fake_quantize(x, scale, axis=None, stochastic=False, seed=0, out_fmt=floatfmt.FP32):
    """Quantize, dequantize and round to ``out_fmt``; return (output, sum of squared error).

    The squared error is summed in float64 between ``x`` and the float32 output.
    """
    x = np.asarray(x, dtype=np.float32)
    y = dequantize(quantize(x, scale, axis, 127, stochastic, seed), scale, axis)
    y = round_to_format(y, out_fmt)
    err = y.astype(np.float64) - x.astype(np.float64)
    return y, float(np.sum(err * err))


# ---------------------------------------------------------------- float formats


def _quiet(fn):
    """Run ``fn`` without NumPy's warnings for NaN/Inf casts (their results are intended)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with np.errstate(invalid="ignore", over="ignore"):
            return fn(*args, **kwargs)

    return wrapper


def _fmt_params(fmt):
    e, m, sat, _ = fmt
    bias = (1 << (e - 1)) - 1
    emin = 1 - bias
    if sat:
        max_val = (2.0 - 2.0 ** (1 - m)) * 2.0 ** ((1 << e) - 1 - bias)
    else:
        max_val = (2.0 - 2.0**-m) * 2.0 ** ((1 << e) - 2 - bias)
    return e, m, sat, bias, emin, max_val


@_quiet
def round_to_format(x, fmt):
    """Round float32 ``x`` to the nearest value of ``fmt`` (RNE), as float32.

    IEEE-like formats overflow to ±Inf (a value rounds to Inf when it is at least
    ``max + half an ulp`` with the tie going to Inf, the even side); saturating formats clamp
    to ±max, Inf included. NaN stays NaN with its bits unchanged.
    """
    x = np.asarray(x, dtype=np.float32)
    e, m, sat, bias, emin, max_val = _fmt_params(fmt)
    xd = x.astype(np.float64)
    finite = np.isfinite(xd)
    ax = np.where(finite, np.abs(xd), 0.0)
    _, ex = np.frexp(ax)  # ax = f * 2**ex, f in [0.5, 1)
    binade = np.maximum(ex - 1, emin)
    quantum = np.ldexp(1.0, binade - m)
    r = np.round(ax / quantum) * quantum  # exact in float64; np.round is half-to-even
    if m == 0:  # a tie between 2**b and 2**(b+1): the even code is the even exponent field
        tie = (ax / quantum == 1.5) & ((binade + bias) % 2 == 0)
        r = np.where(tie, quantum, r)
    if sat:
        r = np.minimum(r, max_val)
    else:
        # IEEE 754's overflow rule: |x| >= max + half an ulp of the top binade gives Inf. For
        # M >= 1 rounding already does that (max's mantissa is odd); for M = 0 the tie at
        # 1.5 * 2**emax would otherwise go to max, whose exponent field is even.
        half_ulp = 2.0 ** ((1 << e) - 3 - bias - m)
        r = np.where((r > max_val) | (ax >= max_val + half_ulp), np.inf, r)
    r = np.where(finite, r, np.where(sat, max_val, np.inf))
    out = np.copysign(r, xd).astype(np.float32)
    return np.where(np.isnan(x), x, out)


@_quiet
def encode_format(x, fmt):
    """Codes of float32 ``x`` in ``fmt`` (one of the four torch formats), as int64."""
    x = np.asarray(x, dtype=np.float32)
    e, m, sat, bias, emin, _ = _fmt_params(fmt)
    r = np.abs(round_to_format(x, fmt).astype(np.float64))
    frac, ex = np.frexp(np.where(np.isfinite(r), r, 0.0))
    normal = r >= 2.0**emin
    exp_field = np.where(normal, ex - 1 + bias, 0)
    man = np.where(normal, (frac * 2 - 1) * 2**m, r / 2.0 ** (emin - m))
    code = (exp_field.astype(np.int64) << m) | np.rint(man).astype(np.int64)
    code = np.where(np.isinf(r), ((1 << e) - 1) << m, code)
    bits = x.view(np.uint32).astype(np.int64)
    sign = (bits >> 31) << (e + m)
    nan = np.array([floatfmt.encode(int(b), fmt) for b in bits[np.isnan(x)]], dtype=np.int64)
    code = sign | code
    code[np.isnan(x)] = nan
    return code


# ---------------------------------------------------------------- gradient compression


APS_ZERO_EXPONENT = -150


def aps_exponent(x, n_workers):
    """APS: ``ceil(log2(max |n·x|))``; ``APS_ZERO_EXPONENT`` for an all-zero tensor."""
    amax = float(absmax(x)) * n_workers
    if amax == 0:
        return APS_ZERO_EXPONENT
    f, ex = np.frexp(amax)
    return int(ex if f > 0.5 else ex - 1)


def aps_shift(exponent, fmt):
    """APS: ``(2**(e-1) - 1) - exponent``, clamped to [-300, 300] so 2**shift stays usable."""
    bias = (1 << (fmt[0] - 1)) - 1
    return int(np.clip(bias - exponent, -300, 300))


def pow2_factors(shift):
    """Two float32 powers of two whose product is 2**shift (each one normal)."""
    half = shift // 2
    return np.float32(2.0**half), np.float32(2.0 ** (shift - half))


@_quiet
def round_scaled(x, p1, p2, fmt):
    """Round ``x * p1 * p2`` (float32 products) to ``fmt``; no product when both are 1."""
    x = np.asarray(x, dtype=np.float32)
    if p1 != 1 or p2 != 1:
        x = (x * np.float32(p1) * np.float32(p2)).astype(np.float32)
    return round_to_format(x, fmt)


def aps_quantize(x, shift, fmt):
    """APS: round ``x * 2**shift`` to ``fmt`` (values stay scaled)."""
    return round_scaled(x, *pow2_factors(shift), fmt)


def aps_dequantize(y, shift):
    """APS: ``y * 2**-shift`` in float32."""
    return round_scaled(y, *pow2_factors(-shift), floatfmt.FP32)


def qsgd_levels_scale(global_max, n_workers):
    """Global-QSGD standard dithering: (levels per worker, float32 unit) for scale M."""
    levels = 127 // n_workers
    return levels, np.float32(np.float32(global_max) / np.float32(levels))


def exp_dither_encode(x, global_max, seed=0):
    """Global-QSGD exponential dithering: sign bit + 7-bit code c (value 2**-(c-1), 0 = zero).

    ``r = |x| / M`` (float32) in ``[2**-k-1, 2**-k)`` rounds up to ``2**-k`` with probability
    ``r·2**(k+1) - 1`` (the float32 mantissa fraction, exactly), else down: unbiased.
    Below ``2**-126`` it rounds between 0 and ``2**-126``; ``r >= 1`` gives code 1.
    """
    x = np.asarray(x, dtype=np.float32)
    m = np.float32(global_max)
    r = (np.abs(x) / (m if m > 0 else np.float32(1))).astype(np.float32)
    rb = r.view(np.uint32).astype(np.int64)
    eb = rb >> 23
    mant = rb & 0x7FFFFF
    u24 = rng_bits(rng_key(seed), np.arange(x.size, dtype=np.int64)).reshape(x.shape) >> 8
    up = u24 < 2 * mant
    k_low = 127 - eb  # exponent of the lower neighbour 2**-k_low (eb >= 1)
    code = np.where(eb >= 1, k_low + 1 - up, np.where(up, 127, 0))
    code = np.where(eb >= 127, 1, code)
    code = np.where(m > 0, code, 0)
    sign = np.where((x.view(np.uint32) >> 31) & (code > 0), 0x80, 0)
    return (sign | code).astype(np.uint8)


def exp_dither_decode(codes, global_max):
    """Inverse of ``exp_dither_encode``: ``±M · 2**-(c-1)``, 0 for c = 0."""
    c = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    k = (c & 0x7F) - 1
    mag = np.where(k >= 0, (np.maximum(127 - k, 1) << 23), 0).astype(np.uint32).view(np.float32)
    val = (np.float32(global_max) * mag).astype(np.float32)
    return np.where(c & 0x80, -val, val).astype(np.float32)


def cgx_meta(x, bucket_size, bits):
    """CGX: per group of ``bucket_size`` elements, (min, unit) with unit = (max-min)/(2**b-1)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    levels = (1 << bits) - 1
    groups = -(-x.size // bucket_size)
    meta = np.zeros((groups, 2), dtype=np.float32)
    for g in range(groups):
        chunk = x[g * bucket_size : (g + 1) * bucket_size].astype(np.float64)
        meta[g, 0] = chunk.min()
        meta[g, 1] = np.float32((chunk.max() - chunk.min()) / levels)
    return meta


def cgx_codes(x, meta, bucket_size, bits, stochastic=True, seed=0):
    """CGX codes ``clip(floor((x - min)·inv + r), 0, 2**b - 1)``, all in float32, with
    ``inv = float32(1 / unit)`` (0 for a constant group).

    ``r`` is uniform with 16 random bits (stochastic, :func:`pair_uniform16`) or 0.5
    (nearest, CGX's deterministic build).
    """
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    g = np.arange(x.size) // bucket_size
    mn = meta[g, 0].astype(np.float32)
    unit = meta[g, 1].astype(np.float32)
    inv = np.where(unit > 0, np.float32(1) / np.where(unit > 0, unit, np.float32(1)),
                   np.float32(0)).astype(np.float32)
    if stochastic:
        u = pair_uniform16(seed, x.size)
    else:
        u = np.float32(0.5)
    v = np.floor((x - mn) * inv + u)
    return np.clip(v, 0, (1 << bits) - 1).astype(np.int64)


def cgx_decode_codes(codes, meta, bucket_size):
    """CGX values ``min + unit·q`` in float32."""
    g = np.arange(codes.size) // bucket_size
    return (meta[g, 0].astype(np.float32)
            + meta[g, 1].astype(np.float32) * codes.astype(np.float32)).astype(np.float32)


def pack_bits(codes, bits):
    """Pack b-bit codes little-endian: code j occupies bits [j·b, (j+1)·b) of the stream.

    The stream is padded to whole groups of 8 codes, so it holds ``ceil(n/8)·b`` bytes.
    """
    codes = np.asarray(codes, dtype=np.int64)
    n8 = -(-codes.size // 8) * 8
    padded = np.zeros(n8, dtype=np.int64)
    padded[: codes.size] = codes
    bitplane = (padded[:, None] >> np.arange(bits)) & 1  # [n8, bits], LSB first
    return np.packbits(bitplane.reshape(-1).astype(np.uint8), bitorder="little")


def unpack_bits(payload, bits, n):
    """Inverse of ``pack_bits``: the first ``n`` codes."""
    stream = np.unpackbits(np.asarray(payload, dtype=np.uint8), bitorder="little")
    planes = stream[: n * bits].reshape(n, bits).astype(np.int64)
    return (planes << np.arange(bits)).sum(axis=1)


def l2norm(x):
    """Euclidean norm accumulated in float64."""
    x = np.asarray(x, dtype=np.float64)
    return float(np.sqrt(np.sum(x * x)))


def qsgd_scale(norm, levels):
    """QSGD unit ``float32(norm) / s``."""
    return np.float32(np.float32(norm) / np.float32(levels))
