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

from qsync_lab.compress.codec import (NONFINITE, Encoded, Wire, check_finite, compression_error,
                                     float_target, into, packed_parts, padded, take)
from qsync_lab.kernels import l2norm, qsgd_decode, qsgd_decode_sum, qsgd_encode

__all__ = ["encode", "levels", "reduce", "wire"]


def levels(spec) -> int:
    """Levels on each side of zero: ``2**(bits-1) - 1``."""
    return 2 ** (spec.bits - 1) - 1


def encode(x, segments, spec, comm, seed, error: bool = False, workspace=None) -> Encoded:
    numel = x.numel()
    data, (norm_part, codes) = packed_parts(workspace, x.device, (torch.float32, 1),
                                            (torch.int8, numel))
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


def reduce(encoded: Encoded, spec, comm, out=None, workspace=None) -> torch.Tensor:
    """The ranks' codes, each scaled by its own norm, summed in one pass over the mean."""
    data, numel = encoded.payload, encoded.context
    gathered = take(workspace, "gathered", comm.world * data.numel(), data.dtype, data.device)
    rows = comm.all_gather(data, out=gathered)
    table = gathered.view(comm.world, -1) if comm.world > 1 else rows[0].view(1, -1)
    norms = table[:, :4].view(torch.float32)  # each rank's payload: its norm, then its codes
    check_finite(norms, "a qsgd bucket")
    total = float_target(out, numel, workspace)
    qsgd_decode_sum(table[:, 4:4 + numel].view(torch.int8), norms.view(-1).tolist(),
                    levels(spec), divisor=comm.world, out=total.view(-1))
    return total if total is out else into(out, total)


def wire(numel: int, segments, spec, world: int) -> Wire:
    return Wire("allgather", float(padded(numel + 4)), 0.0, 4 + 4 + 1, 1 + 4 + 4)
