"""Float-format emulation on float32 bit patterns: one scalar source for every backend.

A format is a tuple of four ints ``(E, M, SAT, NAN)``:

* ``E`` exponent bits (1..8) and ``M`` mantissa bits (0..23), exponent bias ``2**(E-1)-1``,
  subnormals kept, round-to-nearest-even everywhere (a mantissa carry moves into the next
  binade, and out of the top binade to infinity or to the saturation value);
* ``SAT = 0``: IEEE-like, the top exponent is reserved for Inf/NaN and overflow gives Inf;
  ``SAT = 1``: OCP "fn" (e4m3fn), the top exponent holds normal numbers, only
  ``S.1111.111`` is NaN, and finite overflow and ±Inf saturate to ±max (exactly what
  ``tensor.to(torch.float8_e4m3fn)`` does in torch 2.13);
* ``NAN``: how a NaN is encoded, copied from torch's casts: ``NAN_PAYLOAD`` (fp16: sign,
  all-ones exponent, quiet bit, top payload bits), ``NAN_ONES`` (fp8: sign and all ones),
  ``NAN_ALL`` (bf16: every bit set, 0xFFFF).

``encode`` maps float32 bits (an unsigned 32-bit int) to the format's code, bit-exact with
torch's cast; ``round_bits`` maps float32 bits to the float32 bits of the nearest
representable value (emulation held in float32, like CPD's ``cast_precision`` without its
bugs). NaN inputs come back unchanged from ``round_bits``. Everything is integer arithmetic
except one exact power-of-two product for subnormal results, so results are identical on
every backend. ``build(jit)`` compiles the set with a Numba decorator (``njit`` or
``cuda.jit(device=True)``); the plain functions are the simulator's and the tests' versions.
"""

from types import SimpleNamespace

import numpy as np

NAN_PAYLOAD = 0
NAN_ONES = 1
NAN_ALL = 2

FP16 = (5, 10, 0, NAN_PAYLOAD)
BF16 = (8, 7, 0, NAN_ALL)
FP8_E4M3 = (4, 3, 1, NAN_ONES)
FP8_E5M2 = (5, 2, 0, NAN_ONES)
FP32 = (8, 23, 0, NAN_PAYLOAD)  # identity; used for exact power-of-two rescaling


def ieee_format(exp_bits, man_bits):
    """Return the format tuple of an IEEE-like (exp_bits, man_bits) format (CPD style)."""
    return (int(exp_bits), int(man_bits), 0, NAN_PAYLOAD)


def encode(b, fmt):
    """Return the code of float32 bits ``b`` (0 <= b < 2**32) in format ``fmt``."""
    E, M, sat, nan_mode = fmt
    b = np.int64(b)
    bias = (1 << (E - 1)) - 1
    sh = 23 - M
    emin_b = 128 - bias  # float32 biased exponent of the format's smallest normal
    exp_all = ((1 << E) - 1) << M
    sign = (b >> 31) << (E + M)
    a = b & 0x7FFFFFFF
    if a > 0x7F800000:
        if nan_mode == NAN_PAYLOAD:
            return sign | exp_all | (1 << (M - 1)) | ((a & 0x7FFFFF) >> sh)
        if nan_mode == NAN_ONES:
            return sign | exp_all | ((1 << M) - 1)
        return (1 << (E + M + 1)) - 1
    e = a >> 23
    if e >= emin_b:
        # Normal: round the float32 bits themselves; a mantissa carry moves into the exponent.
        if sh > 0:
            a = (a + (1 << (sh - 1)) - 1 + ((a >> sh) & 1)) >> sh
        mag = a - ((127 - bias) << M)
    else:
        # Subnormal in the format: count quanta of 2**(emin - M) in the significand.
        sig = a & 0x7FFFFF
        if e > 0:
            sig = sig | 0x800000
        s2 = min(sh + emin_b - max(e, 1), 26)
        if s2 > 0:
            sig = (sig + (1 << (s2 - 1)) - 1 + ((sig >> s2) & 1)) >> s2
        mag = sig
    limit = exp_all
    if sat:
        limit = exp_all | ((1 << M) - 2)
    return sign | min(mag, limit)


def decode(code, fmt):
    """Return the float32 bits of a non-NaN code in format ``fmt``."""
    E, M, sat, nan_mode = fmt
    code = np.int64(code)
    bias = (1 << (E - 1)) - 1
    exp_all = ((1 << E) - 1) << M
    sign = (code >> (E + M)) & 1
    mag = code & ((1 << (E + M)) - 1)
    if sat == 0 and mag >= exp_all:
        bits = 0x7F800000
    elif mag >= (1 << M):
        bits = (mag + ((127 - bias) << M)) << (23 - M)
    else:
        # mag * 2**(emin - M), as two exact power-of-two products (the second may be subnormal).
        p1 = np.uint32((128 - bias) << 23).view(np.float32)
        p2 = np.uint32((127 - M) << 23).view(np.float32)
        value = np.float32(np.float32(mag) * p1 * p2)
        bits = np.int64(value.view(np.uint32))
    return bits | (sign << 31)


def _make_round(enc, dec):
    def round_bits(b, fmt):
        """Return the float32 bits of ``b`` rounded to ``fmt`` (NaN bits unchanged)."""
        if (b & 0x7FFFFFFF) > 0x7F800000:
            return b
        return dec(enc(b, fmt), fmt)

    return round_bits


round_bits = _make_round(encode, decode)


def build(jit):
    """Compile ``encode``, ``decode`` and ``round_bits`` with the decorator ``jit``."""
    enc = jit(encode)
    dec = jit(decode)
    return SimpleNamespace(encode=enc, decode=dec, round_bits=jit(_make_round(enc, dec)))
