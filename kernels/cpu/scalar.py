"""The scalar numerics the kernels inline: ``floatfmt``'s functions compiled with ``njit``,
and ``rng``'s counter hash in 32-bit lanes."""

import numpy as np
from numba import njit

from .. import floatfmt, rng

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


def _encode_fn(fmt):
    """The faster of ``floatfmt``'s equivalent encoders for ``fmt``."""
    return ff_encode_narrow if floatfmt.is_narrow(fmt) else ff_encode


def _round_fn(fmt):
    """The fastest of ``floatfmt``'s equivalent rounding functions for ``fmt``."""
    if floatfmt.is_narrow(fmt):
        return ff_round_narrow
    return ff_round_wide if floatfmt.is_wide(fmt) else ff_round


_UNIT24 = np.float32(2.0**-24)
_UNIT16 = np.float32(2.0**-16)
_MUL_A = np.uint32(rng.MUL_A)
_MUL_B = np.uint32(rng.MUL_B)
_U32 = np.uint32(0xFFFFFFFF)


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

    Runs never cross a multiple of 2**32 (``layout._no_wrap``), so a loop passes
    ``uint32(j)`` and the run's constant high word, and the index stays in 32-bit lanes too.
    """
    return np.float32(np.int32(_hash32(key, lo, hi) >> np.uint32(8))) * _UNIT24


@njit
def _pair_uniforms(h):
    """The two uniform float32 numbers in [0, 1) of a pair hash: ``(low 16 bits, high 16 bits)
    * 2**-16`` (see ``rng.py``)."""
    return (np.float32(np.int32(h & np.uint32(0xFFFF))) * _UNIT16,
            np.float32(np.int32(h >> np.uint32(16))) * _UNIT16)
