"""CGX: bucketed max-min quantization to 1..8 bits, bit-packed."""

import math
from typing import NamedTuple

import torch

from qsync_lab.errors import QSyncError

from . import reference as ref
from .plumbing import (
    _arr,
    _backend,
    _check_float,
    _check_rounding,
    _check_seed,
    _empty,
    _f32,
    _from_numpy,
    _kernels,
)
from .reductions import _finite_absmax
from .rng import rng_key


class CGXPacked(NamedTuple):
    """CGX bucketed max-min codes: packed payload, (min, unit) per bucket, and layout."""

    payload: torch.Tensor
    meta: torch.Tensor
    shape: tuple
    dtype: torch.dtype
    bits: int
    bucket_size: int


def cgx_encode(x, bits, bucket_size=512, *, rounding="stochastic", seed=0, backend="auto"):
    """CGX bucketed max-min quantization to ``bits`` (1..8) bits, bit-packed.

    Per bucket of ``bucket_size`` consecutive elements: ``unit = (max - min)/(2**b - 1)``
    (float32 metadata), codes ``floor((x - min)/unit + r)`` clamped to [0, 2**b - 1] with
    ``r`` uniform ("stochastic", unbiased) or 0.5 ("nearest"). Codes are packed
    little-endian, 8 codes per ``bits`` bytes.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import cgx_decode, cgx_encode
        >>> p = cgx_encode(torch.tensor([0.0, 1.0, 2.0, 3.0]), 2, rounding="nearest")
        >>> p.payload.tolist(), cgx_decode(p).tolist()
        ([[228, 0]], [0.0, 1.0, 2.0, 3.0])
    """
    _check_float(x)
    stochastic = _check_rounding(rounding)
    _check_seed(seed)
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise QSyncError(f"bits must be an int in 1..8, got {bits!r}")
    if not isinstance(bucket_size, int) or bucket_size < 1:
        raise QSyncError(f"bucket_size must be a positive int, got {bucket_size!r}")
    be = _backend(x, backend)
    _finite_absmax(x, None, be)
    n = x.numel()
    groups = -(-n // bucket_size)
    levels = (1 << bits) - 1
    if be == "reference":
        xf = x.detach().cpu().float().numpy()
        meta = ref.cgx_meta(xf, bucket_size, bits)
        codes = ref.cgx_codes(xf, meta, bucket_size, bits, stochastic, seed)
        payload = ref.pack_bits(codes, bits).reshape(-1, bits) if n else None
        payload = _from_numpy(payload, x.device) if n else _empty((0, bits), dtype=torch.uint8)
        meta = _from_numpy(meta, x.device)
    else:
        xf = _f32(x.detach())
        meta = _empty((groups, 2), dtype=torch.float32, device=x.device)
        payload = _empty((-(-n // 8), bits), dtype=torch.uint8, device=x.device)
        if n:
            k = _kernels(be)
            k.cgx_meta(_arr(xf), bucket_size, levels, _arr(meta).reshape(groups, 2))
            k.cgx_encode(_arr(xf), _arr(meta).reshape(groups, 2), bucket_size, bits, stochastic,
                         rng_key(seed), _arr(payload))
    return CGXPacked(payload.to(x.device), meta, tuple(x.shape), x.dtype, bits, bucket_size)


def cgx_decode(packed, *, backend="auto"):
    """Unpack CGX codes and return ``min + unit·q`` in the original shape and dtype."""
    if not isinstance(packed, CGXPacked):
        raise QSyncError("cgx_decode takes the CGXPacked returned by cgx_encode")
    payload, meta = packed.payload, packed.meta
    be = _backend(payload, backend)
    n = math.prod(packed.shape)
    if be == "reference":
        codes = ref.unpack_bits(payload.cpu().numpy().reshape(-1), packed.bits, n)
        out = _from_numpy(ref.cgx_decode_codes(codes, meta.cpu().numpy(), packed.bucket_size),
                          payload.device)
    else:
        out = _empty(n, dtype=torch.float32, device=payload.device)
        if n:
            _kernels(be).cgx_decode(_arr(payload.contiguous()), _arr(meta).reshape(-1, 2),
                                    packed.bucket_size, packed.bits, _arr(out))
    return out.reshape(packed.shape).to(packed.dtype)
