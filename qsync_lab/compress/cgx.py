"""CGX: max-min quantization of groups of values to 1-8 bits, bit-packed, all-gathered.

Per group of ``group_size`` consecutive values: ``unit = (max - min) / (2**bits - 1)`` and
codes ``floor((x - min) / unit + r)``, ``r`` uniform (``stochastic``: unbiased) or 0.5
(``nearest``: biased, error feedback recommended), packed 8 codes to ``bits`` bytes
(``qsync_lab.kernels.cgx_encode``). Each rank's packed codes and (min, unit) pairs are
all-gathered as one byte tensor and every rank decodes and averages them: one quantization
per value, no re-quantization of partial sums. On ``b`` bits a value costs
``b + 64 / group_size`` bits on the wire.
"""

import torch

from qsync_lab.compress.codec import Encoded, Wire, check_finite, pack, unpack
from qsync_lab.kernels import CGXPacked, cgx_decode, cgx_encode

__all__ = ["encode", "reduce", "wire"]


def encode(x, segments, spec, comm, seed, own: bool = False) -> Encoded:
    n = x.numel()
    groups = -(-n // spec.group_size)
    if bool(torch.isfinite(x).all()):
        packed = cgx_encode(x, spec.bits, spec.group_size, rounding=spec.rounding, seed=seed)
    else:  # a NaN unit tells every rank
        packed = CGXPacked(torch.zeros((-(-n // 8), spec.bits), dtype=torch.uint8),
                           torch.full((groups, 2), float("nan")), x.shape, torch.float32,
                           spec.bits, spec.group_size)
    layout = ((torch.float32, groups * 2), (torch.uint8, packed.payload.numel()))
    return Encoded(pack(packed.meta, packed.payload), (packed, layout),
                   cgx_decode(packed) if own else None)


def reduce(encoded: Encoded, spec, comm) -> torch.Tensor:
    template, layout = encoded.context
    total = None
    for data in comm.all_gather(encoded.payload):
        meta, payload = unpack(data, *layout)
        check_finite(meta, "a cgx bucket")
        value = cgx_decode(template._replace(meta=meta.reshape(-1, 2),
                                             payload=payload.reshape(-1, spec.bits)))
        total = value if total is None else total.add_(value)
    return total.div_(comm.world)


def wire(numel: int, segments, spec, world: int) -> Wire:
    groups = -(-numel // spec.group_size)
    payload = -(-numel // 8) * spec.bits + 8 * groups
    return Wire("allgather", float(payload), 0.0, 8 + spec.bits / 8 + world * (spec.bits / 8 + 4))
