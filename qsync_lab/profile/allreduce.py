"""Measure allreduce times on the real backend and fit the α–β model of a link.

:func:`profile_allreduce` spawns ``world_size`` processes (``torch.multiprocessing`` with a
``FileStore`` rendezvous, so no port is needed), each with one intra-op thread, and times
``dist.all_reduce`` of an fp32 tensor of each size: warm-up calls, then the median of
``repeats`` calls, every call started together after a barrier and ended when the
slowest rank is done (the time rank 0 reports). :func:`fit_alpha_beta` fits
``time = a·bytes + b`` on relative residuals (the sizes span four decades) and reads the
link off the ring model of :mod:`qsync_lab.costs.comm`: ``a = 2(n−1)/n / β`` and
``b = 2(n−1)·α``.

Example::

    >>> import numpy as np
    >>> sizes = np.array([1e3, 1e5, 1e6, 1e7])
    >>> fit = fit_alpha_beta(sizes, 2 * 40e-6 * 1e6 + sizes / 2e9 * 1e6, world_size=2,
    ...                      link="loopback")
    >>> round(fit.link.bandwidth_Bps / 1e9, 3), round(fit.link.latency_s * 1e6, 3), fit.r2
    (2.0, 40.0, 1.0)
"""

import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qsync_lab.devices import US_PER_SECOND, LinkSpec
from qsync_lab.errors import QSyncError
from qsync_lab.hostmem import keep_freed_memory
from qsync_lab.profile.fit import LineFit, fit_line

__all__ = ["AlphaBetaFit", "default_sizes", "fit_alpha_beta", "profile_allreduce"]

_FP32_BYTES = 4


@dataclass(frozen=True)
class AlphaBetaFit:
    """A link fitted to measured allreduces.

    Attributes:
        link: the :class:`LinkSpec` (bandwidth β, latency α) the ring model needs.
        line: the fitted ``time_us = a·bytes + b``.
        world_size: ranks of the measured allreduces.
        r2: coefficient of determination of the line.
    """

    link: LinkSpec
    line: LineFit
    world_size: int

    @property
    def r2(self) -> float:
        return round(self.line.r2, 6)


def fit_alpha_beta(nbytes: Sequence[float], time_us: Sequence[float], *, world_size: int,
                   link: str, source: str = "measured") -> AlphaBetaFit:
    """Fit measured ring-allreduce times of ``nbytes`` to α–β (see the module docstring).

    Raises:
        QSyncError: fewer than 2 ranks or 2 distinct sizes, or a fit with a non-positive
            slope or intercept.
    """
    if world_size < 2:
        raise QSyncError(f"an allreduce fit needs at least 2 ranks, got {world_size}")
    line = fit_line(nbytes, time_us, relative=True)
    steps = 2 * (world_size - 1)
    if line.slope <= 0 or line.intercept <= 0:
        raise QSyncError(f"allreduce times do not fit a positive line (slope {line.slope:.3g} "
                         f"us/B, intercept {line.intercept:.3g} us); measure more sizes")
    bandwidth = steps / world_size / (line.slope / US_PER_SECOND)
    latency = line.intercept / steps / US_PER_SECOND
    return AlphaBetaFit(LinkSpec(link, float(bandwidth), float(latency),
                                 f"fit:{source} (R2 {line.r2:.4f})"), line, world_size)


def profile_allreduce(sizes_bytes: Sequence[int], *, backend: str = "gloo", world_size: int = 2,
                      repeats: int = 20, warmup: int = 3) -> pd.DataFrame:
    """Median allreduce time per size on ``backend`` over ``world_size`` local processes.

    Returns:
        Columns ``bytes, time_us`` (rank 0's view; every call ends with the slowest rank).
    """
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise QSyncError(f"nccl needs {world_size} GPUs, found {torch.cuda.device_count()}; "
                         "use backend='gloo'")
    with tempfile.TemporaryDirectory() as folder:
        store, out = os.path.join(folder, "store"), os.path.join(folder, "times.csv")
        mp.start_processes(_worker, args=(world_size, backend, store, out, list(sizes_bytes),
                                          repeats, warmup), nprocs=world_size,
                           start_method="spawn")
        return pd.read_csv(out)


def _worker(rank: int, world_size: int, backend: str, store_path: str, out: str,
            sizes: list[int], repeats: int, warmup: int) -> None:
    keep_freed_memory()  # as the ranks (qsync_lab.hostmem)
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    rows = []
    for size in sizes:
        tensor = torch.ones(max(1, int(size) // _FP32_BYTES),
                            device=f"cuda:{rank}" if cuda else "cpu")
        samples = []
        for i in range(warmup + repeats):
            dist.barrier()
            begin = time.perf_counter()
            dist.all_reduce(tensor)
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                samples.append((time.perf_counter() - begin) * US_PER_SECOND)
        rows.append((tensor.numel() * _FP32_BYTES, statistics.median(samples)))
    if rank == 0:
        pd.DataFrame(rows, columns=["bytes", "time_us"]).to_csv(out, index=False)
    dist.destroy_process_group()


def default_sizes() -> np.ndarray:
    """Allreduce sizes in bytes: every power of 4 from 4 KiB to 64 MiB.

    Example::

        >>> default_sizes()[:3].tolist(), int(default_sizes()[-1]) // 2**20
        ([4096, 16384, 65536], 64)
    """
    return 4 ** np.arange(6, 14)
