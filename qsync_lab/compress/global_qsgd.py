"""Global-QSGD: one scale shared by all ranks, stochastic integer codes summed in the allreduce.

1. every rank's max |x| is all-reduced (MAX) into the shared scale ``M``;
2. ``standard`` dithering: each rank rounds ``x / (M / L)`` stochastically to integers in
   ``[-L, L]`` with ``L = (2**(bits-1) - 1) // world``, so the ranks' codes sum in an
   ordinary integer allreduce (int8, int16 or int32 as ``bits`` says) without overflow,
   and the sum times ``M / L`` over the world size is the mean;
   ``exponential`` dithering: each rank's codes are a sign and a power of two
   (``qsync_lab.kernels.global_qsgd_encode``), which do not sum as integers: they are
   all-gathered and decoded one by one.

Both are unbiased: the expected decoded mean is the true mean (no error feedback needed).
The variance of a standard-dithered value is at most ``unit**2 / 4`` per rank with
``unit = M / L``, so the mean's per-element variance is at most ``unit**2 / (4 world)``.
"""

import math

import torch

from qsync_lab.compress.codec import NONFINITE, Encoded, Wire, check_finite, into
from qsync_lab.errors import QSyncError
from qsync_lab.kernels import (absmax, dequantize_int8, global_qsgd_decode, global_qsgd_encode,
                               quantize_int8)

__all__ = ["encode", "levels", "reduce", "wire"]

_CODE_DTYPES = {8: torch.int8, 16: torch.int16, 32: torch.int32}


def levels(spec, world: int) -> int:
    """Levels per rank on each side of zero: ``(2**(bits-1) - 1) // world``.

    Example::

        >>> from qsync_lab.compress.spec import CompressionSpec
        >>> levels(CompressionSpec("global_qsgd"), 2), levels(CompressionSpec("global_qsgd", 16), 4)
        (63, 8191)
    """
    count = (2 ** (spec.bits - 1) - 1) // world
    if count < 1:
        raise QSyncError(f"global_qsgd with {spec.bits}-bit codes leaves {world} ranks no "
                         f"level each; use bits={16 if spec.bits == 8 else 32}")
    return count


def encode(x, segments, spec, comm, seed, own: bool = False) -> Encoded:
    amax = float(absmax(x))  # NaN or Inf when x holds one
    scale = torch.tensor([amax if math.isfinite(amax) else NONFINITE], dtype=torch.float32)
    comm.allreduce_max(scale)
    check_finite(scale, "a global_qsgd bucket")
    m = float(scale)
    if spec.dithering == "exponential":
        codes = global_qsgd_encode(x, m, comm.world, dithering="exponential", seed=seed)
        decoded = global_qsgd_decode(codes, m, comm.world, dithering="exponential") if own else None
        return Encoded(codes, m, decoded)
    count = levels(spec, comm.world)
    unit = m / count if m > 0 else 1.0
    if spec.bits == 8:
        codes = quantize_int8(x, scale=torch.tensor(unit), rounding="stochastic", seed=seed).codes
    else:  # wider codes: rounded in torch, the same way
        generator = torch.Generator().manual_seed(seed)
        scaled = x / unit
        codes = torch.floor(scaled + torch.rand(x.shape, generator=generator)).to(
            _CODE_DTYPES[spec.bits])
    return Encoded(codes, unit, codes.float().mul_(unit) if own else None)


def reduce(encoded: Encoded, spec, comm, out=None) -> torch.Tensor:
    if spec.dithering == "exponential":
        total = None
        for codes in comm.all_gather(encoded.payload):
            value = global_qsgd_decode(codes, encoded.context, comm.world,
                                       dithering="exponential")
            total = value if total is None else total.add_(value)
        return into(out, total.div_(comm.world))
    total = comm.allreduce_sum(encoded.payload)
    unit = encoded.context / comm.world
    if total.dtype == torch.int8:  # the kernel writes the mean straight into the bucket
        return dequantize_int8(total, torch.tensor(unit), dtype=out.dtype if out is not None
                               else torch.float32, out=out)
    return into(out, total.float().mul_(unit))


def wire(numel: int, segments, spec, world: int) -> Wire:
    if spec.dithering == "exponential":
        return Wire("allgather", float(numel), 4.0, 4 + 4 + 1, 1 + 4 + 4)
    code_bytes = spec.bits // 8
    return Wire("allreduce", float(numel * code_bytes), 4.0, 4 + 4 + code_bytes, code_bytes + 4)

