"""CPU kernels: ``@njit(parallel=True)`` over contiguous NumPy arrays, one module a family.

``reductions`` (abs-max, sum of squares), ``int8``, ``floats`` (float-format casts),
``global_qsgd`` and ``cgx``, on ``layout`` (how a kernel walks the array: chunks, row
segments, period vectors), ``scalar`` (``floatfmt``'s and ``rng``'s functions as compiled
here) and ``jit`` (the disk cache). The launchers the torch-facing API calls are re-exported
here; ``cuda.py``'s namesakes take the same arguments.

Float32 values are read as ``uint32``/``int32`` bit views where the bits matter (abs-max, float
formats). Nothing here allocates outputs except small partial-result arrays and period
vectors; the Python wrappers pass preallocated outputs. Numerics follow ``reference.py`` exactly
(no fastmath): quantize keeps the true division ``x / s`` (a reciprocal multiply changes the
rounding of some quotients, e.g. ties of ``rint``; the division is not the bottleneck here:
``vdivps`` retires 8 quotients every few cycles, far above what memory delivers). The hot
loops compile to packed instructions: abs-max ``vpand``/``vpmaxsd``, dequantize
``vpmovsxbd``/``vcvtdq2ps``/``vmulps``, RNE quantize ``vdivps``/``vroundps``/``vcvttps2dq``
with packed stores, the float casts blend-based in 32-bit lanes, stochastic rounding's hash in
32-bit lanes (``scalar.rng_bits32``).

Compilation: kernels are compiled on first use and cached on disk (``cache=True``; Numba
puts the cache in ``__pycache__`` beside the module, or in its user-wide cache directory when
that is read-only; with no writable place at all they are compiled per process). The cache
key also holds a digest of the sources the kernels inline (see ``jit.py``). So the first
calls compile (slow, once per install), and later processes load the compiled kernels.

Threading: Numba's default layer is used (these loops are memory-bound, so the choice of
layer matters little) and nothing is set at import, since a threading layer is process-wide
and other Numba code may depend on it.
"""

from .cgx import cgx_decode, cgx_decode_mean, cgx_encode, cgx_meta, cgx_meta_encode
from .floats import (float_decode, float_decode_sum, float_encode, float_encode_scaled,
                     float_quantize, float_round)
from .global_qsgd import exp_dither_decode, exp_dither_encode
from .int8 import dequantize, dequantize_sum, fake_quantize, quantize
from .reductions import absmax_bits, sum_squares

__all__ = [
    "absmax_bits",
    "cgx_decode",
    "cgx_decode_mean",
    "cgx_encode",
    "cgx_meta",
    "cgx_meta_encode",
    "dequantize",
    "dequantize_sum",
    "exp_dither_decode",
    "exp_dither_encode",
    "fake_quantize",
    "float_decode",
    "float_decode_sum",
    "float_encode",
    "float_encode_scaled",
    "float_quantize",
    "float_round",
    "quantize",
    "sum_squares",
]
