"""Global-QSGD: encode/decode with one scale shared by all workers (standard or exponential)."""

import math

import torch

from qsync_lab.errors import QSyncError

from . import reference as ref
from .int8 import _quantize, dequantize_int8
from .plumbing import (
    _arr,
    _backend,
    _check_float,
    _check_seed,
    _check_workers,
    _empty,
    _f32,
    _from_numpy,
    _kernels,
)
from .reductions import _finite_absmax
from .rng import rng_key


def _check_global_max(x, global_max, be):
    m = float(global_max)
    if not math.isfinite(m) or m < 0:
        raise QSyncError(f"global_max must be finite and >= 0, got {m}; all-reduce MAX absmax(x)")
    local = float(_finite_absmax(x, None, be))
    if local > m:
        raise QSyncError(
            f"global_max={m} is below this tensor's max |x| = {local}; "
            "pass the all-reduced MAX of absmax over all workers"
        )
    return m


def global_qsgd_encode(x, global_max, n_workers, *, dithering="standard", seed=0,
                       backend="auto"):
    """Global-QSGD encode with a shared scale ``global_max`` (M, the max |x| over workers).

    ``"standard"``: int8 codes in [-L, L], ``L = 127 // n_workers``, stochastic rounding of
    ``x / (M/L)`` (unbiased), so n workers' codes sum in int8 without overflow.
    ``"exponential"``: uint8 codes, sign bit + 7-bit exponent c (value ``M·2**-(c-1)``,
    0 = zero), unbiased randomized rounding between neighbouring powers of two.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import global_qsgd_encode
        >>> global_qsgd_encode(torch.tensor([1.0, -0.5]), 1.0, 2).tolist()
        [63, -32]
    """
    _check_float(x)
    _check_seed(seed)
    be = _backend(x, backend)
    if dithering == "standard":
        levels, unit = ref.qsgd_levels_scale(
            _check_global_max(x, global_max, be), _check_workers(n_workers, 127)
        )
        scale = torch.full((1,), float(unit), dtype=torch.float32, device=x.device)
        return _quantize(x, None, scale, levels, True, seed, be)
    if dithering != "exponential":
        raise QSyncError(f"unknown dithering {dithering!r}; choose 'standard' or 'exponential'")
    _check_workers(n_workers)
    m = _check_global_max(x, global_max, be)
    if be == "reference":
        codes = ref.exp_dither_encode(x.detach().cpu().float().numpy(), m, seed)
        return _from_numpy(codes, x.device)
    codes = _empty(x.shape, dtype=torch.uint8, device=x.device)
    if x.numel():
        _kernels(be).exp_dither_encode(_arr(_f32(x.detach())), float(m), rng_key(seed),
                                       _arr(codes))
    return codes


def global_qsgd_decode(codes, global_max, n_workers, *, dithering="standard", backend="auto"):
    """Decode Global-QSGD codes (a worker's, or for "standard" the int8 sum over workers).

    Returns float32 values; divide a decoded sum by n_workers for the mean.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import global_qsgd_decode
        >>> global_qsgd_decode(torch.tensor([63, -32], dtype=torch.int8), 1.0, 2).tolist()
        [1.0, -0.5079365372657776]
    """
    m = float(global_max)
    if dithering == "standard":
        levels, unit = ref.qsgd_levels_scale(m, _check_workers(n_workers, 127))
        return dequantize_int8(codes, torch.tensor(float(unit)), backend=backend)
    if dithering != "exponential":
        raise QSyncError(f"unknown dithering {dithering!r}; choose 'standard' or 'exponential'")
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise QSyncError("exponential codes must be a uint8 torch.Tensor (from global_qsgd_encode)")
    be = _backend(codes, backend)
    if be == "reference":
        return _from_numpy(ref.exp_dither_decode(codes.cpu().numpy(), m), codes.device)
    out = _empty(codes.shape, dtype=torch.float32, device=codes.device)
    if codes.numel():
        _kernels(be).exp_dither_decode(_arr(codes.contiguous()), m, _arr(out))
    return out
