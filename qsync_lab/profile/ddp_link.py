"""The link as DDP's allreduces see it: α–β fitted on real DDP steps of held-out MLPs.

:func:`~qsync_lab.profile.profile_allreduce` times collectives on idle ranks that start
together after a barrier. Inside a DDP step they run while the other rank still computes,
on the cores that compute (gloo on CPU), and DDP's reducer and forward add their own work.
So DDP adds more to a step than the microbenchmark's α–β and the bucket copies account
for, and a simulator costing allreduces with the microbenchmark's link under-predicts
real steps.

:func:`measure_ddp_overhead` runs calibration MLPs (never the models being predicted)
in ``world_size`` spawned processes, each timed without DDP and with it, the two kinds of
step alternating in the same processes (the machine's drift over the seconds a
measurement takes hits both alike);
:func:`fit_ddp_link` fits what DDP added, less the bucket copies the simulator counts
separately (3 read-write passes over the buckets: 2 to pack, 1 to unpack; the profile's
``fp32->fp32`` line, :func:`copy_pass_us`), to the ring allreduce cost of the model's DDP
buckets::

    ddp_us - plain_us - copies_us = α · 2(n−1) · buckets + wire_bytes / β

so the simulator, costing each bucket's allreduce with the fitted link, adds what DDP
really adds to a step.

A model with buffers (BatchNorm statistics) also has DDP broadcast them from rank 0 before
every forward. That blocking gloo broadcast of a few KiB costs several allreduce
latencies per step: :func:`measure_buffer_broadcast` times
calibration MLPs with BatchNorm under DDP with and without that broadcast
(``forward_sync_buffers``) and :func:`fit_buffer_broadcast` turns the difference into a
link of its own (:func:`broadcast_link_name`), which
:meth:`qsync_lab.costs.CostModel.broadcast_time_us` uses in place of the allreduce link.

Example::

    >>> import pandas as pd
    >>> frame = pd.DataFrame({"buckets": [1, 2, 2], "wire_bytes": [1e6, 4e6, 16e6],
    ...                       "bucket_bytes": [1e6, 4e6, 16e6], "plain_ms": [1.0, 2.0, 3.0],
    ...                       "ddp_ms": [1.7, 4.4, 11.4]})
    >>> fit = fit_ddp_link(frame, lambda nbytes: 0.0, link="loopback")
    >>> round(fit.link.latency_s * 1e6), round(fit.link.bandwidth_Bps / 1e9, 2)
    (100, 2.0)
"""

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from qsync_lab.costs.comm import ring_wire_bytes
from qsync_lab.costs.model import BROADCAST_SUFFIX
from qsync_lab.devices import US_PER_SECOND, LinkSpec
from qsync_lab.errors import QSyncError
from qsync_lab.graph import ddp_buckets, trace_graph
from qsync_lab.hostmem import keep_freed_memory
from qsync_lab.profile.allreduce import AlphaBetaFit
from qsync_lab.profile.fit import LineFit
from qsync_lab.profile.timing import spawned_numba_threads

__all__ = ["BROADCAST_MLPS", "COMPRESSION_MLPS", "DEFAULT_MLPS", "broadcast_link_name",
           "copy_pass_us", "fit_buffer_broadcast", "fit_compressed_steps", "fit_ddp_link",
           "measure_buffer_broadcast", "measure_compressed_steps", "measure_ddp_overhead"]

#: (width, depth) of the calibration MLPs: Linear+ReLU blocks, batch 16
DEFAULT_MLPS = ((64, 2), (64, 8), (64, 16), (512, 2), (512, 8), (512, 16))
#: (width, depth) of the buffer-broadcast calibration MLPs (Linear+BatchNorm1d+ReLU blocks)
BROADCAST_MLPS = ((64, 2), (64, 8), (512, 4))
#: (width, depth) of the compressed-step calibration MLPs: 33 K to 17 M parameters (one
#: bucket of 130 KB, as a small CNN has, to buckets of 1 MiB, DDP's first, and 25 MB)
COMPRESSION_MLPS = ((64, 8), (512, 4), (512, 16), (1024, 8), (1024, 16))
_BATCH = 16
_FP32_BYTES = 4
_COMPRESS_MODE = "compress:"


def broadcast_link_name(link: str) -> str:
    """The name DDP's measured buffer broadcast over ``link`` goes by in a profile."""
    return f"{link}{BROADCAST_SUFFIX}"


def copy_pass_us(cast_fits: "dict[str, LineFit]") -> Callable[[float], float]:
    """One read-write pass over n bytes of fp32, from :func:`~qsync_lab.profile.fit_casts`'s
    ``fp32->fp32`` line (never negative).

    Example::

        >>> copy_pass_us({"fp32->fp32": LineFit(0.25e-3, 5.0, 1.0, 4)})(4e6)
        255.0
    """
    if "fp32->fp32" not in cast_fits:
        raise QSyncError("the cast fits lack fp32->fp32: profile DDP's copies "
                         "(profile_casts([('fp32', 'fp32')], default_copy_sizes()))")
    fit = cast_fits["fp32->fp32"]
    return lambda nbytes: max(0.0, fit.slope * nbytes / _FP32_BYTES + fit.intercept)


def _mlp(width: int, depth: int, norm: bool = False) -> nn.Module:
    torch.manual_seed(depth)
    return nn.Sequential(*[layer for _ in range(depth)
                           for layer in (nn.Linear(width, width),
                                         *([nn.BatchNorm1d(width)] if norm else []), nn.ReLU())])


def measure_ddp_overhead(mlps: Sequence[tuple[int, int]] = DEFAULT_MLPS, *,
                         world_size: int = 2, threads: int = 1, steps: int = 120,
                         warmup: int = 30) -> pd.DataFrame:
    """Median step of each calibration MLP in ``world_size`` processes at once, without DDP
    and with it (gloo; alternating steps of two copies), and its DDP buckets.

    Returns:
        One row per MLP: ``width, depth, buckets, bucket_bytes, wire_bytes, plain_ms,
        ddp_ms``.
    """
    _check_run_args(world_size, threads, steps, warmup)
    rows = []
    for width, depth in mlps:
        model = _mlp(width, depth)
        graph = trace_graph(model, torch.randn(_BATCH, width))
        sizes = ddp_buckets(graph).groupby("bucket")["bytes"].sum().to_numpy(float)
        plain, ddp = _run(width, depth, world_size, threads, steps, warmup, "ddp")
        rows.append({"width": width, "depth": depth, "buckets": len(sizes),
                     "bucket_bytes": float(sizes.sum()),
                     "wire_bytes": float(sum(ring_wire_bytes(b, world_size) for b in sizes)),
                     "plain_ms": plain, "ddp_ms": ddp})
    return pd.DataFrame(rows)


def fit_ddp_link(frame: pd.DataFrame, copy_us: Callable[[float], float], *, link: str,
                 world_size: int = 2, source: str = "ddp-calibration") -> AlphaBetaFit:
    """Fit :func:`measure_ddp_overhead`'s rows to α–β (see the module docstring).

    Args:
        frame: the measured rows.
        copy_us: time of one read-write pass over that many bytes (:func:`copy_pass_us`);
            the buckets are packed in 2 passes and unpacked in 1.
        link: the link's name; world_size: ranks in the ring.

    Raises:
        QSyncError: fewer than 2 rows, or a fit whose α or β is not positive.
    """
    if len(frame) < 2:
        raise QSyncError("a DDP link fit needs at least 2 calibration models")
    copies = np.array([3 * copy_us(b) for b in frame["bucket_bytes"]])
    added_us = (frame["ddp_ms"] - frame["plain_ms"]).to_numpy(float) * 1e3 - copies
    per_collective = 2 * (world_size - 1) * frame["buckets"].to_numpy(float)
    design = np.column_stack([per_collective, frame["wire_bytes"].to_numpy(float)])
    (latency_us, us_per_byte), *_ = np.linalg.lstsq(design, added_us, rcond=None)
    if latency_us <= 0 or us_per_byte <= 0:
        raise QSyncError(f"DDP's added step time does not fit a positive α–β (α {latency_us:.3g}"
                         f" us, {us_per_byte:.3g} us/B); measure larger calibration models")
    predicted = design @ np.array([latency_us, us_per_byte])
    residual = float(((added_us - predicted) ** 2).sum())
    total = float(((added_us - added_us.mean()) ** 2).sum())
    r2 = 1.0 - residual / total if total > 0 else 1.0
    spec = LinkSpec(link, float(US_PER_SECOND / us_per_byte), float(latency_us / US_PER_SECOND),
                    f"fit:{source} (R2 {r2:.4f})")
    return AlphaBetaFit(spec, LineFit(float(us_per_byte), float(latency_us), r2, len(frame)),
                        world_size)


def measure_buffer_broadcast(mlps: Sequence[tuple[int, int]] = BROADCAST_MLPS, *,
                             world_size: int = 2, threads: int = 1, steps: int = 120,
                             warmup: int = 30) -> pd.DataFrame:
    """Median DDP step of each BatchNorm MLP without and with the buffer broadcast before
    every forward (``forward_sync_buffers``), alternating steps of two copies in the same
    processes.

    Returns:
        One row per MLP: ``width, depth, buffer_bytes, without_ms, with_ms``.
    """
    _check_run_args(world_size, threads, steps, warmup)
    rows = []
    for width, depth in mlps:
        buffers = sum(b.numel() * b.element_size() for b in _mlp(width, depth, True).buffers())
        without, with_ = _run(width, depth, world_size, threads, steps, warmup, "broadcast")
        rows.append({"width": width, "depth": depth, "buffer_bytes": float(buffers),
                     "without_ms": without, "with_ms": with_})
    return pd.DataFrame(rows)


def fit_buffer_broadcast(frame: pd.DataFrame, link: LinkSpec, *,
                         world_size: int = 2) -> LinkSpec:
    """DDP's buffer broadcast as a link: ``link``'s bandwidth, and the latency per hop that
    makes ``(n−1)·α + bytes/β`` the median of what broadcasting added to the steps.

    Example::

        >>> frame = pd.DataFrame({"buffer_bytes": [0.0, 0.0, 0.0], "without_ms": [2.0] * 3,
        ...                       "with_ms": [3.1, 3.2, 3.6]})
        >>> fit = fit_buffer_broadcast(frame, LinkSpec("loopback", 1e9, 1e-4, "x"))
        >>> fit.name, round(fit.latency_s * 1e6)
        ('loopback-ddp-broadcast', 1200)
    """
    if not len(frame):
        raise QSyncError("a buffer-broadcast fit needs at least 1 calibration model")
    added_us = (frame["with_ms"] - frame["without_ms"]).to_numpy(float) * 1e3
    wire_us = frame["buffer_bytes"].to_numpy(float) / link.bandwidth_Bps * US_PER_SECOND
    latency_us = float(np.median(added_us - wire_us)) / (world_size - 1)
    if latency_us <= 0:
        raise QSyncError(f"broadcasting DDP's buffers added no time ({latency_us:.3g} us per "
                         "hop); measure again on a quieter machine")
    return LinkSpec(broadcast_link_name(link.name), link.bandwidth_Bps,
                    latency_us / US_PER_SECOND,
                    f"fit:ddp buffer broadcast, median of {len(frame)} MLPs")


def measure_compressed_steps(specs: Sequence[str], mlps: Sequence[tuple[int, int]] =
                             COMPRESSION_MLPS, *, world_size: int = 2, threads: int = 1,
                             steps: int = 80, warmup: int = 15) -> pd.DataFrame:
    """Median step of each calibration MLP under DDP without and with each spec's hook, in
    ``world_size`` processes (alternating steps of two copies).

    Returns:
        One row per (spec, MLP): ``spec, width, depth, ddp_ms, compressed_ms``.
    """
    _check_run_args(world_size, threads, steps, warmup)
    rows = []
    for spec in specs:
        for width, depth in mlps:
            plain, compressed = _run(width, depth, world_size, threads, steps, warmup,
                                     _COMPRESS_MODE + str(spec))
            rows.append({"spec": str(spec), "width": width, "depth": depth, "ddp_ms": plain,
                         "compressed_ms": compressed})
    return pd.DataFrame(rows)


def fit_compressed_steps(frame: pd.DataFrame, costs, cluster, *,
                         device: str = "cpu") -> pd.DataFrame:
    """What each spec's hook added to the measured steps beyond the simulator's estimate of
    it (:func:`~qsync_lab.simulate.compression.bucket_comm` with ``costs`` on
    ``cluster``), as profile rows: ``phase="compress"``, ``kind="in_step"``, ``op`` the
    spec's cost label, and per compressed group call its elements (``numel``) and the
    residual (``time_us``, may be negative). The cost model fits them to a line per spec
    (:meth:`~qsync_lab.costs.CostModel.compression_time_us` with step ``"in_step"``) and the
    simulator adds it to every compressed group: the hook's thread hand-offs, its
    encode sharing the cores with the backward, gloo's speed on 8- and 16-bit payloads.
    """
    from qsync_lab.compress import CompressionSettings, CompressionSpec
    from qsync_lab.compress.spec import bucket_groups
    from qsync_lab.costs import PROFILE_COLUMNS
    from qsync_lab.simulate import prepare_graph
    from qsync_lab.simulate.compression import bucket_comm

    rows = []
    for (width, depth), group in frame.groupby(["width", "depth"], sort=False):
        prepared = prepare_graph(trace_graph(_mlp(width, depth), torch.randn(_BATCH, width)))
        plain_us = sum(b.cost.us for b in bucket_comm(prepared, cluster, costs, None))
        params = dict(_mlp(width, depth).named_parameters())
        for spec, ddp_ms, compressed_ms in zip(group["spec"], group["ddp_ms"],
                                               group["compressed_ms"]):
            settings = CompressionSettings.parse(spec)
            calls = [g for _, members in prepared.buckets.groupby("bucket", sort=True)
                     for g in bucket_groups(list(members["param"]),
                                            [params[n] for n in members["param"]], settings)
                     if g.spec is not None]
            if not calls:
                raise QSyncError(f"calibration MLP {width}x{depth} has nothing {spec} compresses")
            estimate_us = sum(b.cost.us for b in bucket_comm(prepared, cluster, costs, spec))
            residual_us = (compressed_ms - ddp_ms) * 1e3 - (estimate_us - plain_us)
            numel = sum(g.numel for g in calls)
            rows.append({"device": device, "op": CompressionSpec.parse(spec).cost_label,
                         "kind": "in_step", "shape_key": f"mlp{width}x{depth}",
                         "precision": "fp32", "plan_precision": "fp32", "phase": "compress",
                         "batch_size": _BATCH, "numel": numel / len(calls), "flops": 0.0,
                         "bytes": 4.0 * numel / len(calls),
                         "time_us": residual_us / len(calls), "repeats": 0})
    return pd.DataFrame(rows, columns=list(PROFILE_COLUMNS))


def _check_run_args(world_size: int, threads: int, steps: int, warmup: int) -> None:
    if world_size < 2 or threads < 1 or steps < 1 or warmup < 0:
        raise QSyncError("world_size must be >= 2, threads and steps >= 1, warmup >= 0")


def _run(width: int, depth: int, world_size: int, threads: int, steps: int,
         warmup: int, mode: str) -> tuple[float, float]:
    """Median step ms of one calibration MLP, from one set of processes: (plain, DDP) for
    ``mode="ddp"``, (DDP, DDP broadcasting BatchNorm buffers) for ``"broadcast"``, (DDP,
    DDP with the compression hook) for ``"compress:<spec>"``."""
    with tempfile.TemporaryDirectory() as folder:
        store, out = os.path.join(folder, "store"), os.path.join(folder, "ms")
        with spawned_numba_threads(threads):
            mp.start_processes(_worker, args=(world_size, store, out, width, depth, threads,
                                              steps, warmup, mode), nprocs=world_size,
                               start_method="spawn")
        with open(out) as f:
            first_ms, second_ms = map(float, f.read().split())
        return first_ms, second_ms


def _worker(rank: int, world_size: int, store_path: str, out: str, width: int, depth: int,
            threads: int, steps: int, warmup: int, mode: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    keep_freed_memory()  # as the ranks (qsync_lab.hostmem)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size)
    if mode == "ddp":
        first, second = _mlp(width, depth), _mlp(width, depth)
        nets = (first, DistributedDataParallel(second))
    elif mode.startswith(_COMPRESS_MODE):
        from qsync_lab.compress import register_compression

        first, second = _mlp(width, depth), _mlp(width, depth)
        nets = (DistributedDataParallel(first), DistributedDataParallel(second))
        register_compression(nets[1], mode[len(_COMPRESS_MODE):])  # as a run registers it
    else:
        first, second = _mlp(width, depth, norm=True), _mlp(width, depth, norm=True)
        nets = (DistributedDataParallel(first, forward_sync_buffers=False),
                DistributedDataParallel(second))
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9)
                  for m in (first, second)]
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(_BATCH, width, generator=generator), torch.randn(_BATCH, width,
                                                                       generator=generator)
    loss_fn = nn.MSELoss()
    samples: tuple[list[float], list[float]] = ([], [])
    for i in range(warmup + steps):  # the two kinds of step alternate: drift hits both alike
        for net, optimizer, times in zip(nets, optimizers, samples):
            dist.barrier()  # every step starts together, as the trainer's per-step gather does
            begin = time.perf_counter()
            optimizer.zero_grad()
            loss_fn(net(x), y).backward()
            optimizer.step()
            if i >= warmup:
                times.append((time.perf_counter() - begin) * 1e3)
    mine = torch.tensor([statistics.median(t) for t in samples], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's medians set the steps
    if rank == 0:
        with open(out, "w") as f:
            f.write(" ".join(f"{float(v):.6f}" for v in mine))
    dist.barrier()  # the result is written
    # gloo's teardown at interpreter exit aborts intermittently beside a DDP reducer
    # ("terminate called without an active exception"): leave without it, as the runtime does
    os._exit(0)
