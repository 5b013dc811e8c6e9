"""Time precision conversions as the runtime performs them and fit ``a·numel + b`` per pair.

A conversion from ``src`` to ``dst`` is what the runtime does when an operand held in
``src`` is read by a ``dst`` kernel: ``reencode(encode(x, src), src, dst)``
(:mod:`qsync_lab.quant.encoding`; int8 includes finding the scale). A pair with
``src == dst`` is an in-place copy into an existing buffer, as DDP copies gradients into
and out of its buckets. Each pair is timed on fp32 tensors of several sizes, on ``device``:
the CPU, or a CUDA GPU (``device="cuda"``), where the conversions are the native path's
casts and quantize steps (int8 scale and codes, fp8 scaled casts) and are timed with CUDA
events (:func:`~qsync_lab.profile.timing.median_time_us`); the rows are named after the
device (:func:`~qsync_lab.profile.device.profile_device_name`). :func:`fit_casts` fits
the time per pair with R².

Example::

    >>> rows = profile_casts([("fp32", "fp16")], [1024, 4096], repeats=3, warmup=1)
    >>> rows[["precision", "numel", "bytes"]].values.tolist()
    [['fp32->fp16', 1024, 6144.0], ['fp32->fp16', 4096, 24576.0]]
    >>> fits = fit_casts(rows)
    >>> list(fits), 0 <= fits["fp32->fp16"].samples
    (['fp32->fp16'], True)

On a GPU: ``profile_casts([("fp32", "int8")], default_cast_sizes(), device="cuda")``.
"""

from collections.abc import Callable, Sequence

import pandas as pd
import torch

from qsync_lab.costs import PROFILE_COLUMNS
from qsync_lab.hostmem import keep_freed_memory
from qsync_lab.precision import Precision
from qsync_lab.profile.device import profile_device, profile_device_name, to_device
from qsync_lab.profile.fit import LineFit, fit_line
from qsync_lab.profile.timing import median_time_us
from qsync_lab.quant.encoding import encode, reencode

__all__ = ["default_cast_sizes", "default_copy_sizes", "fit_casts", "profile_casts"]


def default_cast_sizes() -> list[int]:
    """Element counts from 4 Ki to 4 Mi, every power of 4.

    Example::

        >>> default_cast_sizes()[0], default_cast_sizes()[-1] // 2**20
        (4096, 4)
    """
    return [4**k for k in range(6, 12)]


def default_copy_sizes() -> list[int]:
    """Element counts for DDP's bucket copies (``fp32->fp32``): 4 Ki to 16 Mi, as its
    buckets hold up to 25 MB (about 6.5 Mi fp32 elements).

    Example::

        >>> default_copy_sizes()[-1] // 2**20
        16
    """
    return [4**k for k in range(6, 13)]


def profile_casts(pairs: Sequence[tuple[str, str]], sizes: Sequence[int], *,
                  device: "torch.device | str" = "cpu", repeats: int = 10,
                  warmup: int = 2) -> pd.DataFrame:
    """Median conversion time of each (src, dst) pair at each element count on ``device``
    (``cpu`` or ``cuda``).

    Returns:
        Cast rows with the columns of :data:`qsync_lab.costs.PROFILE_COLUMNS`
        (``phase="cast"``, ``precision="src->dst"``, ``bytes`` read plus written).
    """
    keep_freed_memory()  # as the ranks (qsync_lab.hostmem)
    device = profile_device(device)
    device_name = profile_device_name(device)
    rows = []
    generator = torch.Generator().manual_seed(0)
    for src_name, dst_name in pairs:
        src, dst = Precision.parse(src_name), Precision.parse(dst_name)
        for numel in sizes:
            values = to_device(torch.randn(int(numel), generator=generator), device)
            time_us = median_time_us(_conversion(values, src, dst), repeats=repeats,
                                     warmup=warmup, device=device)
            rows.append({"device": device_name, "op": "", "kind": "cast", "shape_key": "",
                         "precision": f"{src}->{dst}", "plan_precision": f"{src}->{dst}",
                         "phase": "cast", "batch_size": 0,
                         "numel": int(numel), "flops": 0.0,
                         "bytes": numel * (src.bits + dst.bits) / 8, "time_us": time_us,
                         "repeats": repeats})
    return pd.DataFrame(rows, columns=list(PROFILE_COLUMNS))


def _conversion(values: torch.Tensor, src: Precision, dst: Precision) -> Callable[[], object]:
    """The timed call: an in-place copy when ``src is dst``, else the runtime's re-encode."""
    if src is dst:
        out = torch.empty_like(values)
        return lambda: out.copy_(values)
    held = encode(values, src)
    return lambda: reencode(held, src, dst)


def fit_casts(rows: pd.DataFrame) -> dict[str, LineFit]:
    """``time_us = a·numel + b`` per ``src->dst`` of the cast rows, with R²."""
    casts = rows[rows["phase"] == "cast"]
    return {pair: fit_line(group["numel"], group["time_us"])
            for pair, group in casts.groupby("precision", sort=False)}
