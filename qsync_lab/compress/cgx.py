"""CGX: max-min quantization of groups of values to 1-8 bits, bit-packed, all-gathered.

Per group of ``group_size`` consecutive values: ``unit = (max - min) / (2**bits - 1)`` and
codes ``floor((x - min) / unit + r)``, ``r`` uniform (``stochastic``: unbiased to within
2**-16 of a unit, the resolution of its 16 random bits) or 0.5
(``nearest``: biased, error feedback recommended), packed 8 codes to ``bits`` bytes
(``qsync_lab.kernels.cgx_encode``). Each rank's packed codes and (min, unit) pairs are
all-gathered as one byte tensor and every rank decodes and averages them: one quantization
per value, no re-quantization of partial sums. On ``b`` bits a value costs
``b + 64 / group_size`` bits on the wire.
"""

import math

import torch

from qsync_lab.compress.codec import (Encoded, check_finite, float_target, into, nonfinite,
                                     on_device, packed_parts, take, unpack)
from qsync_lab.kernels import cgx_decode_mean, cgx_encode

__all__ = ["encode", "reduce"]


def encode(x, segments, spec, comm, seed, error: bool = False, workspace=None) -> Encoded:
    numel = x.numel()
    layout = ((torch.float32, 2 * -(-numel // spec.group_size)),
              (torch.uint8, -(-numel // 8) * spec.bits))
    data, (meta, payload) = packed_parts(workspace, x.device, *layout)
    # a non-finite group's meta is not finite: every rank sees it after the all-gather
    # the error is written while each group is in cache
    errors = take(workspace, "error", numel, torch.float32, x.device).view(x.shape) if error \
        else None
    device = on_device(x)
    packed = cgx_encode(x, spec.bits, spec.group_size, rounding=spec.rounding, seed=seed,
                        check_finite=False, out=(payload.view(-1, spec.bits), meta.view(-1, 2)),
                        error_out=errors, backend="cuda" if device else "auto")
    if device:  # nothing read back: a non-finite group's error is not finite, and the mark
        # after the all-gather tells the hook to keep no residual of it
        return Encoded(data, (packed, layout), errors)
    finite = error and bool(torch.isfinite(packed.meta).all())
    return Encoded(data, (packed, layout), errors if finite else None)


def reduce(encoded: Encoded, spec, comm, out=None, workspace=None) -> torch.Tensor:
    template, layout = encoded.context
    data = encoded.payload
    gathered = [unpack(row, *layout) for row in comm.all_gather(
        data, out=take(workspace, "gathered", comm.world * data.numel(), data.dtype, data.device))]
    device = on_device(data)
    if device:  # the mark stays on the device; a marked group's values decode to NaN
        nonfinite(torch.cat([meta for meta, _ in gathered]), "a cgx bucket", workspace, True)
    else:
        for meta, _ in gathered:
            check_finite(meta, "a cgx bucket")
    total = float_target(out, math.prod(template.shape), workspace, data.device)
    # every rank's values summed group by group in one pass over the mean
    cgx_decode_mean([template._replace(meta=meta.reshape(-1, 2), shape=tuple(total.shape),
                                       payload=payload.reshape(-1, spec.bits))
                     for meta, payload in gathered], out=total,
                    backend="cuda" if device else "auto")
    return total if total is out else into(out, total)
