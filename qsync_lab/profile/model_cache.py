"""A model's op profile on this machine, measured once by the training ranks and cached.

The shipped profile (``data/profiles/cpu.csv``) times the zoo's ops; any other model would
be costed by the roofline, and its predicted step would be a guess. Before such a model
trains, every rank times its ops inside training steps (:func:`profile_ops`, method
``in_step``) at its own batch size, all ranks at once as they will train (sharing the
cores and the memory bandwidth); rank 0 keeps the median over the ranks of each batch size
and writes the rows to the cache. A later run of the same model (fingerprint), batch
sizes, precisions, intra-op threads and software reads them back.

The cache lives in ``$QSYNC_LAB_CACHE`` (default ``~/.cache/qsync_lab``), under
``profiles/``.

Example::

    >>> key = profile_key("0123abcd", [16, 16], ["fp32", "bf16"], threads=1)
    >>> len(key), key == profile_key("0123abcd", [16, 16], ["bf16", "fp32"], threads=1)
    (16, True)
"""

import hashlib
import os
import platform
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from qsync_lab.costs import write_profile
from qsync_lab.errors import QSyncError
from qsync_lab.profile.concurrent import median_over_processes
from qsync_lab.profile.ops import profile_ops
from qsync_lab.profile.timing import run_metadata

__all__ = ["cache_dir", "profile_key", "ranks_profile_model"]

#: training steps timed per precision (the first WARMUP untimed)
REPEATS, WARMUP = 6, 2


def cache_dir() -> Path:
    """``$QSYNC_LAB_CACHE`` or ``~/.cache/qsync_lab``."""
    return Path(os.environ.get("QSYNC_LAB_CACHE") or Path.home() / ".cache" / "qsync_lab")


def profile_key(fingerprint: str, batch_sizes: Sequence[int], precisions: Sequence[str], *,
                threads: int) -> str:
    """What makes a cached profile valid: the model, the ranks' batches, the precisions,
    the threads, the software and the machine."""
    text = "|".join([fingerprint, ",".join(map(str, batch_sizes)),
                     ",".join(sorted(set(precisions))), str(threads), torch.__version__,
                     platform.machine(), platform.processor(), str(os.cpu_count())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ranks_profile_model(model: nn.Module, example_inputs: tuple, target: torch.Tensor,
                        loss_fn: nn.Module, *, fingerprint: str, batch_sizes: Sequence[int],
                        precisions: Sequence[str], progress: bool = True) -> Path:
    """Call on every rank of the default process group: the path of the model's cached
    profile, measured first if missing (module docstring). ``example_inputs`` and
    ``target`` are this rank's batch (``batch_sizes[rank]``).

    Raises:
        QSyncError: the model cannot be profiled (torch.fx cannot trace it), on every rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = torch.get_num_threads()
    path = cache_dir() / "profiles" / (
        profile_key(fingerprint, batch_sizes, precisions, threads=threads) + ".csv")
    found = [path.exists()]
    dist.broadcast_object_list(found, src=0)
    if found[0]:
        return path
    try:
        rows, error = profile_ops(model, example_inputs, target, loss_fn, precisions,
                                  repeats=REPEATS, warmup=WARMUP,
                                  progress=progress and rank == 0), ""
    except Exception as err:  # fx cannot trace it, or an op fails: every rank must know
        rows, error = None, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    gathered = [None] * world
    dist.all_gather_object(gathered, (rows, error))
    errors = [e for _, e in gathered if e]
    if errors:
        raise QSyncError(f"cannot profile the model's ops ({errors[0]}); its predicted step "
                         "falls back to the roofline")
    if rank == 0:
        by_batch: dict[int, list[pd.DataFrame]] = {}
        for frame, _ in gathered:
            if frame.empty:
                continue
            by_batch.setdefault(int(frame["batch_size"].iloc[0]), []).append(frame)
        medians = [median_over_processes(frames) for frames in by_batch.values()]
        rows = pd.concat(medians, ignore_index=True) if medians else gathered[0][0]
        path.parent.mkdir(parents=True, exist_ok=True)
        write_profile(path, rows, {**run_metadata("cpu", threads=threads),
                                   "model_fingerprint": fingerprint,
                                   "batch_sizes": ",".join(map(str, batch_sizes))})
    dist.barrier()
    return path
