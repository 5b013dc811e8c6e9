"""QSGD: each rank's values scaled by its own L2 norm to ``s`` stochastic levels, all-gathered.

``s = 2**(bits-1) - 1`` levels on each side of zero, codes ``round_stochastic(x s / ||x||)``
as int8 (``qsync_lab.kernels.qsgd_encode``): unbiased, with a per-element variance of at
most ``(||x|| / s)**2 / 4``. The ranks' scales differ, so the codes cannot be summed in
the collective: each rank's codes and norm are all-gathered, and each rank's codes, scaled by
its norm, are added to the mean in one pass over it. Kept as the reference the other
methods are compared with.
"""

import math

import torch

from qsync_lab.compress.codec import (NONFINITE, Encoded, check_finite, compression_error,
                                     cuda_kernels, float_target, into, nonfinite, on_device,
                                     packed_parts, poison, take)
from qsync_lab.kernels import l2norm, qsgd_decode, qsgd_decode_sum, qsgd_encode
from qsync_lab.kernels.plumbing import _arr, _f32, _rows_in_place
from qsync_lab.kernels.rng import rng_key

__all__ = ["encode", "levels", "reduce"]


def levels(spec) -> int:
    """Levels on each side of zero: ``2**(bits-1) - 1``."""
    return 2 ** (spec.bits - 1) - 1


def encode(x, segments, spec, comm, seed, error: bool = False, workspace=None) -> Encoded:
    numel = x.numel()
    data, (norm_part, codes) = packed_parts(workspace, x.device, (torch.float32, 1),
                                            (torch.int8, numel))
    if on_device(x):
        return _encode_on_device(x, spec, seed, error, workspace, data, norm_part, codes)
    norm = l2norm(x)  # NaN or Inf when x holds one
    finite = math.isfinite(norm)
    if finite:
        qsgd_encode(x.reshape(-1), levels(spec), seed=seed, norm=norm, out=codes)
    else:
        codes.zero_()
        norm = NONFINITE
    norm_part.fill_(norm)
    return Encoded(data, numel,
                   compression_error(x, qsgd_decode(codes, norm, levels(spec)), workspace)
                   if error and finite else None)


def _encode_on_device(x, spec, seed, error, workspace, data, norm_part, codes) -> Encoded:
    """:func:`encode` without a host read: the norm (float64 on the device, as ``l2norm``
    takes it) and the unit ``float32(norm) / s`` feed the quantizer as device tensors. A
    non-finite norm is sent as :data:`NONFINITE` (its codes are then meaningless)."""
    kernels, numel = cuda_kernels(), x.numel()
    xf = _f32(x.detach())
    acc = torch.zeros(1, dtype=torch.float64, device=x.device)
    if numel:
        kernels.sum_squares(_arr(xf), _arr(acc))
    norm = acc.sqrt()  # NaN or Inf when x holds one
    unit = _unit(norm.float(), spec)
    if numel:
        kernels.quantize(_arr(xf), _arr(unit), numel, 1, levels(spec), True, rng_key(seed),
                         _arr(codes))
    norm_part.copy_(torch.where(torch.isfinite(norm), norm, NONFINITE))
    decoded = None
    if error:  # qsgd_decode of the codes
        decoded = torch.empty(numel, dtype=torch.float32, device=x.device)
        if numel:
            kernels.dequantize(_arr(codes), _arr(unit), numel, 1, _arr(decoded))
    return Encoded(data, numel,
                   compression_error(x, decoded, workspace) if error else None)


def _unit(norms: torch.Tensor, spec) -> torch.Tensor:
    """``qsgd_scale``, ``float32(norm) / s``, of float32 ``norms``: a true float32 division on
    the device."""
    return norms / torch.full((), levels(spec), dtype=torch.float32, device=norms.device)


def reduce(encoded: Encoded, spec, comm, out=None, workspace=None) -> torch.Tensor:
    """The ranks' codes, each scaled by its own norm, summed in one pass over the mean."""
    data, numel = encoded.payload, encoded.context
    gathered = take(workspace, "gathered", comm.world * data.numel(), data.dtype, data.device)
    rows = comm.all_gather(data, out=gathered)
    table = gathered.view(comm.world, -1) if comm.world > 1 else rows[0].view(1, -1)
    norms = table[:, :4].view(torch.float32)  # each rank's payload: its norm, then its codes
    if on_device(data):  # the norms scale the rows on the device: qsgd_decode_sum's kernel
        bad = nonfinite(norms, "a qsgd bucket", workspace, True)
        total = float_target(out, numel, workspace, data.device)
        if numel:
            rows, stride = _rows_in_place(table[:, 4:4 + numel].view(torch.int8))
            scales = (_unit(norms.reshape(-1), spec) * poison(bad)).contiguous()
            cuda_kernels().dequantize_sum(_arr(rows), stride, _arr(scales), float(comm.world),
                                          _arr(total.view(-1)))
        return total if total is out else into(out, total)
    check_finite(norms, "a qsgd bucket")
    total = float_target(out, numel, workspace, data.device)
    qsgd_decode_sum(table[:, 4:4 + numel].view(torch.int8), norms.view(-1).tolist(),
                    levels(spec), divisor=comm.world, out=total.view(-1))
    return total if total is out else into(out, total)
