"""fp16 and bf16: cast, divide by the world size, allreduce in 16 bits, widen.

PyTorch's ``fp16_compress_hook`` (and its bf16 twin) as a method: dividing before the sum
keeps the n-rank sum in range, rounding is to nearest even (biased; error feedback is an
option). fp16 overflows above 65504 (a gradient that large stops the step on every rank
with :class:`~qsync_lab.compress.codec.NonFiniteGradient`) and flushes values below 2**-24
to zero; bf16 keeps fp32's range with 8 significant bits.

Example::

    >>> import torch, torch.distributed as dist, tempfile
    >>> from qsync_lab.compress.comm import Comm
    >>> from qsync_lab.compress.spec import CompressionSpec
    >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}",
    ...                         rank=0, world_size=1)
    >>> spec, comm = CompressionSpec("bf16"), Comm(None)
    >>> x = torch.tensor([1.0, 1 / 3])
    >>> reduce(encode(x, [(0, 2)], spec, comm, seed=0), spec, comm).tolist()
    [1.0, 0.333984375]
    >>> dist.destroy_process_group()
"""

import torch

from qsync_lab.compress.codec import (Encoded, compression_error, into, nonfinite,
                                     on_device, take)
from qsync_lab.kernels import absmax
from qsync_lab.kernels.plumbing import exact_div_

__all__ = ["encode", "reduce"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def encode(x, segments, spec, comm, seed, error: bool = False, workspace=None) -> Encoded:
    low = take(workspace, "payload", x.numel(), _DTYPES[spec.method], x.device)
    exact_div_(low.copy_(x.reshape(-1)), comm.world)
    return Encoded(low, None, compression_error(x, low.float().mul_(comm.world), workspace)
                   if error else None)


def reduce(encoded: Encoded, spec, comm, out=None, workspace=None) -> torch.Tensor:
    total = comm.allreduce_sum(encoded.payload)
    device = on_device(total)  # there the mark stays on the device, the mean not finite
    nonfinite(absmax(total, backend="cuda" if device else "auto"),
              f"a {spec.method} bucket (or its sum overflowed {spec.method})", workspace, device)
    return into(out, total) if out is not None else total.float()
