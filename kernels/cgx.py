"""CGX: bucketed max-min quantization to 1..8 bits, bit-packed."""

import math
from typing import NamedTuple

import numpy as np
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
    _into,
    _kernels,
    _nan_error,
    _out,
    exact_div_,
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


def cgx_encode(x, bits, bucket_size=512, *, rounding="stochastic", seed=0, check_finite=True,
               backend="auto", out=None, error_out=None):
    """CGX bucketed max-min quantization to ``bits`` (1..8) bits, bit-packed.

    Per bucket of ``bucket_size`` consecutive elements: ``unit = (max - min)/(2**b - 1)``
    (float32 metadata), codes ``floor((x - min)·inv + r)`` clamped to [0, 2**b - 1] in
    float32 arithmetic, ``inv = 1/unit`` and ``r`` uniform ("stochastic": 16 random bits per
    element, unbiased to within 2**-16 of a unit) or 0.5 ("nearest"). Codes are packed
    little-endian, 8 codes per ``bits`` bytes. NaN or Inf in ``x`` raises QSyncError (found
    by the same read of ``x``); with ``check_finite=False`` such a group's meta is not
    finite instead (its codes are undefined), for a caller that checks the meta itself.
    ``out``: optional ``(payload, meta)``, contiguous uint8 ``(ceil(n/8), bits)`` and float32
    ``(groups, 2)`` tensors on x's device, written instead of new ones (a caller that
    encodes the same size again and again keeps them). ``error_out``: optional contiguous
    float32 tensor of x's shape and device that receives the compression error, ``x`` minus
    its values ``min + unit·q`` in float32 (as :func:`cgx_decode` computes them, before the
    cast to x's dtype), for error feedback; on the CPU computed while each group is in cache.

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
    n = x.numel()
    groups = -(-n // bucket_size)
    levels = (1 << bits) - 1
    error = None if error_out is None else _out(error_out, x.shape, torch.float32, x.device,
                                                "error_out")
    fused = error is not None and be == "cpu" and bucket_size % 8 == 0  # in the encode's pass
    if be == "reference":
        if check_finite:
            _finite_absmax(x, None, be)
        xf = x.detach().cpu().float().numpy()
        with np.errstate(invalid="ignore"):  # only where check_finite is False
            meta = ref.cgx_meta(xf, bucket_size, bits)
            codes = ref.cgx_codes(xf, meta, bucket_size, bits, stochastic, seed)
        payload = ref.pack_bits(codes, bits).reshape(-1, bits) if n else None
        payload = _from_numpy(payload, x.device) if n else _empty((0, bits), dtype=torch.uint8)
        meta = _from_numpy(meta, x.device)
        if out is not None:
            payload, meta = (_into(payload, _out(out[0], payload.shape, torch.uint8, x.device,
                                                 "out payload")),
                             _into(meta, _out(out[1], meta.shape, torch.float32, x.device,
                                              "out meta")))
    else:
        xf = _f32(x.detach())
        payload, meta = (None, None) if out is None else out
        meta = _out(meta, (groups, 2), torch.float32, x.device, "out meta")
        payload = _out(payload, (-(-n // 8), bits), torch.uint8, x.device, "out payload")
        if n:
            k = _kernels(be)
            meta2 = _arr(meta).reshape(groups, 2)
            if bucket_size % 8 == 0:  # one read of x
                k.cgx_meta_encode(_arr(xf), bucket_size, bits, stochastic, rng_key(seed), meta2,
                                  _arr(payload), *((_arr(error).reshape(-1),) if fused else ()))
            else:
                k.cgx_meta(_arr(xf), bucket_size, levels, meta2)
                k.cgx_encode(_arr(xf), meta2, bucket_size, bits, stochastic, rng_key(seed),
                             _arr(payload))
            if check_finite and not bool(torch.isfinite(meta).all()):
                raise _nan_error()
    packed = CGXPacked(payload.to(x.device), meta, tuple(x.shape), x.dtype, bits, bucket_size)
    if error is not None and not fused:
        values = cgx_decode(packed._replace(dtype=torch.float32), backend=be)
        torch.sub(x.detach().float(), values, out=error)
    return packed


def cgx_decode(packed, *, out=None, backend="auto"):
    """Unpack CGX codes and return ``min + unit·q`` (float32 arithmetic) in the original shape
    and dtype; with ``out`` (a contiguous float32 tensor of that shape) the values are added
    to it instead, and ``out`` is returned (summing several ranks' payloads, one pass each)."""
    if not isinstance(packed, CGXPacked):
        raise QSyncError("cgx_decode takes the CGXPacked returned by cgx_encode")
    payload, meta = packed.payload, packed.meta
    be = _backend(payload, backend)
    n = math.prod(packed.shape)
    if be == "reference":
        codes = ref.unpack_bits(payload.cpu().numpy().reshape(-1), packed.bits, n)
        values = _from_numpy(ref.cgx_decode_codes(codes, meta.cpu().numpy(), packed.bucket_size),
                             payload.device).reshape(packed.shape)
        return out.add_(values) if out is not None else values.to(packed.dtype)
    target = out if out is not None else _empty(n, dtype=torch.float32, device=payload.device)
    if n:
        _kernels(be).cgx_decode(_arr(payload.contiguous()), _arr(meta).reshape(-1, 2),
                                packed.bucket_size, packed.bits, out is not None,
                                _arr(target).reshape(-1))
    return out if out is not None else target.reshape(packed.shape).to(packed.dtype)


def cgx_decode_mean(packs, *, out=None, backend="auto"):
    """The mean of several CGX payloads' values (the ranks' payloads of one bucket: the same
    shape, bits and bucket size), ``((0 + v_0) + v_1 + ...) / len(packs)`` in float32, the
    sum and rounding of :func:`cgx_decode` with ``out`` applied to each in turn. On the CPU
    in one pass over the result: each group's values of every payload are added while that
    part of the result is in cache. ``out``: a contiguous float32 tensor of the packs'
    shape to write (else a new tensor of their dtype is returned).

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import cgx_decode_mean, cgx_encode
        >>> packs = [cgx_encode(torch.tensor([0.0, 3.0]), 2, rounding="nearest"),
        ...          cgx_encode(torch.tensor([2.0, 5.0]), 2, rounding="nearest")]
        >>> cgx_decode_mean(packs).tolist()
        [1.0, 4.0]
    """
    packs = list(packs)
    if not packs or not all(isinstance(p, CGXPacked) for p in packs):
        raise QSyncError("cgx_decode_mean takes a non-empty list of the CGXPacked returned "
                         "by cgx_encode")
    first = packs[0]
    layout = (first.shape, first.bits, first.bucket_size)
    if any((p.shape, p.bits, p.bucket_size) != layout for p in packs):
        raise QSyncError("cgx_decode_mean: every payload must have the same shape, bits and "
                         f"bucket size, got {[(p.shape, p.bits, p.bucket_size) for p in packs]}")
    device = first.payload.device
    be = _backend(first.payload, backend)
    n = math.prod(first.shape)
    target = _out(out, first.shape, torch.float32, device)
    if be != "cpu":  # one decode per payload added to the sum
        target.zero_()
        for p in packs:
            cgx_decode(p, out=target, backend=be)
        exact_div_(target, len(packs))
    elif n:
        _kernels(be).cgx_decode_mean([_arr(p.payload.contiguous()) for p in packs],
                                     [_arr(p.meta).reshape(-1, 2) for p in packs],
                                     first.bucket_size, first.bits, _arr(target))
    return target if out is not None else target.to(first.dtype)
