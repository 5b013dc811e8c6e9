"""Time the gradient compressors' encode and decode on this machine.

For each spec and size, one parameter's gradient goes through the comm hook
(:func:`~qsync_lab.compress.hook.compression_hook`) on a one-rank gloo group, as a run
calls it: the encode (with error feedback where the spec has it) and the decode of one
rank's payload, read from the hook's telemetry, median of ``repeats`` calls. The rows
(``phase="compress"``, ``kind`` "encode" or "decode", ``op`` the spec's
:attr:`~qsync_lab.compress.CompressionSpec.cost_label`, ``device`` the profile's device
name) let the cost model fit a line per device, spec and step
(:meth:`qsync_lab.costs.CostModel.compression_time_us`).

On a GPU (``device="cuda"``) the gradient is a CUDA tensor: the hook runs its CUDA
kernels, and the telemetry times each part with CUDA events on the stream (the kernels, or
the host launching them where that is slower: what a bucket's compression costs the
stream, unheld), so a GPU cluster's plan with compression is costed from the GPU.

Example::

    >>> rows = profile_compression(["fp16"], [4096], repeats=2)
    >>> rows[["op", "kind", "numel"]].values.tolist()
    [['fp16', 'encode', 4096], ['fp16', 'decode', 4096]]
"""

import statistics
import tempfile
from collections.abc import Sequence
from contextlib import contextmanager

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from qsync_lab.compress.spec import CompressionSpec
from qsync_lab.costs import PROFILE_COLUMNS
from qsync_lab.errors import QSyncError
from qsync_lab.hostmem import keep_freed_memory
from qsync_lab.profile.device import profile_device, profile_device_name

__all__ = ["DEFAULT_COMPRESSION_SPECS", "default_compression_sizes", "profile_compression"]

#: what ``qsync-lab profile --compress`` without specs and the shipped CPU profile time
DEFAULT_COMPRESSION_SPECS = ("fp16", "bf16", "global_qsgd:8", "aps:fp8_e5m2", "cgx:8", "cgx:4",
                             "cgx:4,error_feedback=true", "qsgd:8")


def default_compression_sizes() -> list[int]:
    """Gradient sizes from 64 K to 16 M elements (DDP's buckets hold up to ~6.5 M)."""
    return [4**k for k in range(8, 13)]


def profile_compression(specs: Sequence["str | CompressionSpec"], sizes: Sequence[int], *,
                        device: "str | torch.device" = "cpu", repeats: int = 10,
                        warmup: int = 2) -> pd.DataFrame:
    """Median encode and decode time of each spec at each size on ``device`` ("cpu" or a
    CUDA GPU; see the module docstring).

    Returns:
        Rows with the columns of :data:`qsync_lab.costs.PROFILE_COLUMNS`.
    """
    device = profile_device(device)
    name = profile_device_name(device)
    keep_freed_memory()  # as the ranks (qsync_lab.hostmem)
    rows = []
    generator = torch.Generator().manual_seed(0)
    with _one_rank_group():
        for spec in map(CompressionSpec.parse, specs):
            for numel in map(int, sizes):
                gradient = torch.randn(numel, generator=generator).to(device)
                times = _hook_times(spec, gradient, warmup + repeats)[warmup:]
                for step in ("encode", "decode"):
                    rows.append({"device": name, "op": spec.cost_label, "kind": step,
                                 "shape_key": "", "precision": "fp32",
                                 "plan_precision": "fp32", "phase": "compress",
                                 "batch_size": 0, "numel": numel, "flops": 0.0,
                                 "bytes": 4.0 * numel,
                                 "time_us": statistics.median(t[step] for t in times),
                                 "repeats": repeats})
    return pd.DataFrame(rows, columns=list(PROFILE_COLUMNS))


def _hook_times(spec: CompressionSpec, gradient: torch.Tensor, calls: int) -> list[dict]:
    """Encode and decode µs of ``calls`` hook calls on one parameter holding ``gradient``."""
    from qsync_lab.compress.hook import CompressionState, StandaloneBucket, compression_hook

    model = nn.Module()
    model.weight = nn.Parameter(torch.empty(1, gradient.numel()))  # 2-D: compressed
    state = CompressionState(model, spec, telemetry=False)
    buffer = torch.empty_like(gradient)
    out = []
    try:
        for _ in range(calls):
            buffer.copy_(gradient)
            compression_hook(state, StandaloneBucket(model.weight, buffer)).wait()
            stats = state.telemetry()[spec.method]
            out.append({"encode": 1e3 * stats["encode_ms"], "decode": 1e3 * stats["decode_ms"]})
    finally:
        state.close()
    return out


@contextmanager
def _one_rank_group():
    """A one-rank gloo group: the existing default group if it has one rank, else a
    temporary one."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise QSyncError("profile the compressors in a process of their own (this one "
                             f"is a rank of a {dist.get_world_size()}-rank group)")
        yield
        return
    with tempfile.TemporaryDirectory() as folder:  # the file store removes its file itself
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0,
                                world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
