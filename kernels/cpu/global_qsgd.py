"""Global-QSGD: exponential-dithering codes and their values."""

import numpy as np
from numba import prange

from .jit import _jit
from .scalar import exp_dither_code, exp_dither_value, rng_bits32


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
