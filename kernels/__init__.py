"""Quantization kernels: NumPy reference, Numba CPU and CUDA versions, one torch dispatcher.

Importing this package is cheap and never needs a GPU: Numba is imported and the kernels
are compiled on first use (the CPU kernels once per installation: they are cached on disk).
See ``dispatch.py`` for the conventions (dtypes, layouts, NaN/Inf policy, backends).
"""

from .dispatch import (
    APS_ZERO_EXPONENT,
    BACKENDS,
    CGXPacked,
    FakeQuantResult,
    FloatCodes,
    Int8Tensor,
    QSGDCodes,
    absmax,
    aps_dequantize,
    aps_exponent,
    aps_quantize,
    aps_shift,
    cgx_decode,
    cgx_encode,
    dequantize_int8,
    fake_quantize_int8,
    float_decode,
    float_encode,
    float_quantize,
    float_round,
    global_qsgd_decode,
    global_qsgd_encode,
    l2norm,
    qsgd_decode,
    qsgd_encode,
    quantize_int8,
)

__all__ = [
    "APS_ZERO_EXPONENT",
    "BACKENDS",
    "CGXPacked",
    "FakeQuantResult",
    "FloatCodes",
    "Int8Tensor",
    "QSGDCodes",
    "absmax",
    "aps_dequantize",
    "aps_exponent",
    "aps_quantize",
    "aps_shift",
    "cgx_decode",
    "cgx_encode",
    "dequantize_int8",
    "fake_quantize_int8",
    "float_decode",
    "float_encode",
    "float_quantize",
    "float_round",
    "global_qsgd_decode",
    "global_qsgd_encode",
    "l2norm",
    "qsgd_decode",
    "qsgd_encode",
    "quantize_int8",
]
