"""QSGD: levels scaled by the L2 norm, stochastic rounding to int8 codes."""

import math
from typing import NamedTuple

import torch

from qsync_lab.errors import QSyncError

from . import reference as ref
from .int8 import _quantize, dequantize_int8, dequantize_int8_sum
from .plumbing import _backend, _check_float, _check_seed, _nan_error
from .reductions import l2norm


class QSGDCodes(NamedTuple):
    """QSGD codes in [-levels, levels] with the float32 L2 norm they are scaled by."""

    codes: torch.Tensor
    norm: float
    levels: int


def _check_levels(levels):
    if not isinstance(levels, int) or isinstance(levels, bool) or not 1 <= levels <= 127:
        raise QSyncError(f"levels must be an int in 1..127, got {levels!r}")
    return levels


def qsgd_encode(x, levels, *, seed=0, norm=None, backend="auto", out=None):
    """QSGD: ``s = levels`` levels scaled by the L2 norm, stochastic rounding (unbiased).

    Codes are int8 in [-s, s] with ``x̂ = code · float32(norm) / s``. ``norm`` defaults to
    ``l2norm(x)``; pass it to reuse one (e.g. computed elsewhere). ``out``: optional
    contiguous int8 tensor of x's shape and device for the codes.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import qsgd_encode
        >>> qsgd_encode(torch.tensor([3.0, 4.0]), 5).codes.tolist()
        [3, 4]
    """
    _check_float(x)
    _check_levels(levels)
    _check_seed(seed)
    be = _backend(x, backend)
    if norm is None:
        norm = l2norm(x, backend=be)
    if not math.isfinite(norm) or norm < 0:
        raise _nan_error()
    scale = torch.full((1,), float(ref.qsgd_scale(norm, levels)), device=x.device)
    return QSGDCodes(_quantize(x, None, scale, levels, True, seed, be, out), float(norm), levels)


def qsgd_decode(codes, norm, levels, *, backend="auto", out=None):
    """QSGD: ``codes · float32(norm) / levels`` as float32 (into ``out`` when given).

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import qsgd_decode
        >>> qsgd_decode(torch.tensor([3, 4], dtype=torch.int8), 5.0, 5).tolist()
        [3.0, 4.0]
    """
    _check_levels(levels)
    scale = torch.tensor(float(ref.qsgd_scale(norm, levels)))
    return dequantize_int8(codes, scale, backend=backend, out=out)


def qsgd_decode_sum(codes, norms, levels, *, divisor=1, backend="auto", out=None):
    """The sum of the rows' QSGD values (row ``r`` scaled by ``norms[r]``), over ``divisor``:
    :func:`~qsync_lab.kernels.dequantize_int8_sum` with each row's :func:`qsgd_decode` scale,
    bit for bit what adding each row's :func:`qsgd_decode` to zeros and dividing gives.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import qsgd_decode_sum
        >>> codes = torch.tensor([[3, 4], [5, 0]], dtype=torch.int8)
        >>> qsgd_decode_sum(codes, [5.0, 10.0], 5, divisor=2).tolist()
        [6.5, 2.0]
    """
    _check_levels(levels)
    scales = [float(ref.qsgd_scale(norm, levels)) for norm in norms]
    return dequantize_int8_sum(codes, scales, divisor=divisor, backend=backend, out=out)
