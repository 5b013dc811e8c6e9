"""Global-QSGD: one scale shared by all ranks, stochastic integer codes summed in the allreduce.

1. every rank's max |x| is all-reduced (MAX) into the shared scale ``M``;
2. ``standard`` dithering: each rank rounds ``x / (M / L)`` stochastically to integers in
   ``[-L, L]`` with ``L = (2**(bits-1) - 1) // world``, so the ranks' codes sum in an
   ordinary integer allreduce without overflow (int8 or int32 as ``bits`` says; neither
   gloo nor NCCL sums int16, so 16-bit codes travel two to an int32 word, see
   :func:`pair16`), and the sum times ``M / L`` over the world size is the mean;
   ``exponential`` dithering: each rank's codes are a sign and a power of two
   (``qsync_lab.kernels.global_qsgd_encode``), which do not sum as integers: they are
   all-gathered and decoded one by one.

Both are unbiased: the expected decoded mean is the true mean (no error feedback needed).
The variance of a standard-dithered value is at most ``unit**2 / 4`` per rank with
``unit = M / L``, so the mean's per-element variance is at most ``unit**2 / (4 world)``.
"""

import math

import torch

from qsync_lab.compress.codec import (NONFINITE, Encoded, check_finite, compression_error,
                                     cuda_kernels, into, nonfinite, on_device, poison, take)
from qsync_lab.errors import QSyncError
from qsync_lab.kernels import (absmax, dequantize_int8, global_qsgd_decode, global_qsgd_encode,
                               quantize_int8)
from qsync_lab.kernels.plumbing import _arr, _f32, exact_div_
from qsync_lab.kernels.rng import rng_key

__all__ = ["encode", "levels", "pair16", "reduce", "unpair16"]


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


def encode(x, segments, spec, comm, seed, error: bool = False, workspace=None) -> Encoded:
    if on_device(x):
        return _encode_on_device(x, spec, comm, seed, error, workspace)
    amax = float(absmax(x))  # NaN or Inf when x holds one
    scale = torch.tensor([amax if math.isfinite(amax) else NONFINITE], dtype=torch.float32)
    comm.allreduce_max(scale)
    check_finite(scale, "a global_qsgd bucket")
    m = float(scale)
    if spec.dithering == "exponential":
        codes = global_qsgd_encode(x, m, comm.world, dithering="exponential", seed=seed)
        decoded = global_qsgd_decode(codes, m, comm.world, dithering="exponential") if error \
            else None
        return Encoded(codes, m, None if decoded is None
                       else compression_error(x, decoded, workspace))
    count = levels(spec, comm.world)
    unit = m / count if m > 0 else 1.0
    if spec.bits == 8:
        codes = take(workspace, "payload", x.numel(), torch.int8, x.device).view(x.shape)
        quantize_int8(x, scale=torch.tensor(unit), rounding="stochastic", seed=seed, out=codes)
        payload = codes
    else:  # wider codes: rounded in torch, the same way
        generator = torch.Generator().manual_seed(seed)
        codes = torch.floor(x / unit + torch.rand(x.shape, generator=generator)).to(torch.int32)
        payload = pair16(codes.reshape(-1), count) if spec.bits == 16 else codes
    return Encoded(payload, (unit, count, x.numel()),
                   compression_error(x, codes.float().mul_(unit), workspace) if error else None)


def _encode_on_device(x, spec, comm, seed, error, workspace) -> Encoded:
    """:func:`encode` without a host read: the max, the shared scale ``M``, the unit and the
    mark stay device tensors (the unit in float64 as the CPU path's Python number, then
    rounded to float32 where it is used, so every code and value is the CPU path's)."""
    kernels, device = cuda_kernels(), x.device
    amax = absmax(x, backend="cuda")  # NaN or Inf when x holds one
    scale = torch.where(torch.isfinite(amax), amax, NONFINITE).reshape(1)
    comm.allreduce_max(scale)
    bad = nonfinite(scale, "a global_qsgd bucket", workspace, True)
    m = scale  # float32, on every rank alike
    if spec.dithering == "exponential":
        codes = torch.empty(x.shape, dtype=torch.uint8, device=device)
        if x.numel():
            kernels.exp_dither_encode_dev(_arr(_f32(x.detach())), _arr(m), rng_key(seed),
                                          _arr(codes))
        decoded = _exp_decode(codes, m) if error else None
        return Encoded(codes, (m, bad), None if decoded is None
                       else compression_error(x, decoded, workspace))
    count = levels(spec, comm.world)
    m64 = m[0].double()
    # true divisions by device tensors: a Python divisor would be multiplied by its
    # reciprocal on CUDA (a second rounding)
    unit = torch.where(m64 > 0, m64 / _full(count, torch.float64, device), 1.0)
    unit32 = unit.float().reshape(1)
    if spec.bits == 8:
        codes = take(workspace, "payload", x.numel(), torch.int8, device).view(x.shape)
        if x.numel():
            kernels.quantize(_arr(_f32(x.detach())), _arr(unit32), x.numel(), 1, 127, True,
                             rng_key(seed), _arr(codes))
        payload = codes
    else:  # wider codes: rounded in torch, the same way (the CPU path's random numbers)
        uniform = torch.rand(x.shape, generator=torch.Generator().manual_seed(seed))
        if x.is_cuda:  # copied without the host waiting for it
            uniform = uniform.pin_memory().to(device, non_blocking=True)
        codes = torch.floor(x / unit32[0] + uniform).to(torch.int32)
        payload = pair16(codes.reshape(-1), count) if spec.bits == 16 else codes
    # the decode's scale: the unit over the world size (NaN for a marked bucket)
    scale_out = ((unit / _full(comm.world, torch.float64, device)).float() * poison(bad))
    return Encoded(payload, (scale_out.reshape(1), count, x.numel()),
                   compression_error(x, codes.float().mul_(unit32[0]), workspace)
                   if error else None)


def _full(value, dtype, device) -> torch.Tensor:
    return torch.full((), value, dtype=dtype, device=device)


def _exp_decode(codes: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """One rank's exponential codes decoded with the device max ``m`` (float32, one element)."""
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    if codes.numel():
        cuda_kernels().exp_dither_decode_dev(_arr(codes.contiguous()), _arr(m), _arr(out))
    return out


def pair16(codes: torch.Tensor, count: int) -> torch.Tensor:
    """16-bit codes in ``[-count, count]`` two to an int32 word, so that the ranks' words sum
    in an int32 allreduce as their codes would in int16: the first code of a pair, biased
    by ``count``, fills the low 16 bits, the second (signed) the rest. With
    ``count * world <= 32767`` the low halves sum to at most 65534 (no carry) and the high
    halves stay within int32.

    Example::

        >>> words = pair16(torch.tensor([-3, 2, 5], dtype=torch.int32), 8)
        >>> unpair16(words + words, 2 * 8, 3).tolist()  # two ranks' sum
        [-6, 4, 10]
    """
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 1] * 65536 + (pairs[:, 0] + count)


def unpair16(words: torch.Tensor, bias: int, numel: int) -> torch.Tensor:
    """The summed codes of :func:`pair16` words summed over ranks (``bias``: ``count``
    times the world size)."""
    low = words & 0xFFFF
    return torch.stack([low - bias, (words - low) >> 16], 1).view(-1)[:numel]


def reduce(encoded: Encoded, spec, comm, out=None, workspace=None) -> torch.Tensor:
    if on_device(encoded.payload):
        return _reduce_on_device(encoded, spec, comm, out, workspace)
    if spec.dithering == "exponential":
        total = None
        payload = encoded.payload
        gathered = take(workspace, "gathered", comm.world * payload.numel(), payload.dtype,
                         payload.device)
        for codes in comm.all_gather(payload, out=gathered):
            value = global_qsgd_decode(codes, encoded.context, comm.world,
                                       dithering="exponential")
            total = value if total is None else total.add_(value)
        return into(out, exact_div_(total, comm.world))
    total = comm.allreduce_sum(encoded.payload)
    unit, count, numel = encoded.context
    unit /= comm.world
    if total.dtype == torch.int8:  # the kernel writes the mean straight into the bucket
        return dequantize_int8(total, torch.tensor(unit), dtype=out.dtype if out is not None
                               else torch.float32, out=out)
    if spec.bits == 16:
        total = unpair16(total, count * comm.world, numel)
    return into(out, total.float().mul_(unit).view(out.shape if out is not None else -1))


def _reduce_on_device(encoded: Encoded, spec, comm, out, workspace) -> torch.Tensor:
    """:func:`reduce` with the scale read by the kernels on the device."""
    if spec.dithering == "exponential":
        m, bad = encoded.context
        total = None
        payload = encoded.payload
        gathered = take(workspace, "gathered", comm.world * payload.numel(), payload.dtype,
                        payload.device)
        for codes in comm.all_gather(payload, out=gathered):
            value = _exp_decode(codes, m)
            total = value if total is None else total.add_(value)
        # exact_div_ by the world size, NaN throughout for a marked bucket
        divisor = _full(comm.world, torch.float32, total.device) * poison(bad)
        return into(out, total.div_(divisor))
    total = comm.allreduce_sum(encoded.payload)
    scale, count, numel = encoded.context
    if total.dtype == torch.int8:  # the kernel writes the mean straight into the bucket
        direct = out is not None and out.dtype == torch.float32 and out.is_contiguous()
        mean = out if direct else torch.empty(total.shape, dtype=torch.float32,
                                              device=total.device)
        if total.numel():
            cuda_kernels().dequantize(_arr(total.contiguous()), _arr(scale), total.numel(), 1,
                                      _arr(mean))
        return mean if direct or out is None else into(out, mean)
    if spec.bits == 16:
        total = unpair16(total, count * comm.world, numel)
    return into(out, total.float().mul_(scale[0]).view(out.shape if out is not None else -1))
