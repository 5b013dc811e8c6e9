"""A model's op profile on this machine, measured once by the training ranks and cached.

The shipped profile (``data/profiles/cpu.csv``) times the zoo's ops; any other model would
be costed by the roofline, and its predicted step would be a guess. Before such a model
trains, rank 0 times its ops inside training steps
(:func:`~qsync_lab.profile.profile_ops_concurrently`, method ``in_step``) in as many
spawned processes at once as the run has ranks (sharing the cores and the memory
bandwidth as the ranks will), per distinct batch size, while the ranks wait; the
processes keep the ranks themselves clean of the profiling's state. A model torch.fx
cannot trace (a Hugging Face model) is timed from its hook trace, with one
:class:`~qsync_lab.graph.TracingFallbackWarning`
(:func:`~qsync_lab.profile.in_step.profiled_graph`). Rank 0 writes the median rows to
the cache, with the model's own step overheads: the same processes time
its whole training step (the run's optimizer included) under DDP among themselves, as the
ranks will take it, in fp32 and under a uniform plan of each precision of the run, and
the overheads are calibrated so that the simulator predicts those steps
(:func:`~qsync_lab.profile.overhead.ddp_calibrated_metadata`). A later run of the
same model (fingerprint), batch sizes, precisions, intra-op threads, optimizer, software
and cache format reads them back.

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
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from qsync_lab.costs import write_profile
from qsync_lab.errors import QSyncError
from qsync_lab.optimizers import DEFAULT_OPTIMIZER
from qsync_lab.profile.concurrent import profile_ops_concurrently
from qsync_lab.profile.in_step import profiled_graph
from qsync_lab.profile.overhead import ddp_calibrated_metadata
from qsync_lab.profile.timing import run_metadata
from qsync_lab.resources import cache_dir

__all__ = ["profile_key", "ranks_profile_model"]

#: training steps timed per op row, and per whole step (the overheads are calibrated on
#: those: more steps), after WARMUP untimed ones
REPEATS, STEP_REPEATS, WARMUP = 6, 20, 2
#: what a cached profile holds; a new value leaves older ones unread
CACHE_FORMAT = "model-profile-3"


def profile_key(fingerprint: str, batch_sizes: Sequence[int], precisions: Sequence[str], *,
                threads: int, optimizer: str = DEFAULT_OPTIMIZER) -> str:
    """What makes a cached profile valid: the model, the ranks' batches, the precisions,
    the threads, the optimizer, the software and the machine."""
    text = "|".join([CACHE_FORMAT, fingerprint, ",".join(map(str, batch_sizes)),
                     ",".join(sorted(set(precisions))), str(threads), optimizer,
                     torch.__version__, platform.machine(), platform.processor(),
                     str(os.cpu_count())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ranks_profile_model(model: nn.Module, batches: Mapping[int, tuple[tuple, torch.Tensor]],
                        loss_fn: nn.Module, *, fingerprint: str, batch_sizes: Sequence[int],
                        precisions: Sequence[str], optimizer: str = DEFAULT_OPTIMIZER) -> Path:
    """Call on every rank of the default process group: the path of the model's cached
    profile, measured first if missing (module docstring). ``batches``: per distinct batch
    size of ``batch_sizes``, an ``(inputs, target)`` batch (read on rank 0 only).

    Raises:
        QSyncError: the model cannot be profiled (it does not pickle into the profiling
            processes, or its ops cannot be timed), on every rank.
    """
    threads = torch.get_num_threads()
    path = cache_dir() / "profiles" / (
        profile_key(fingerprint, batch_sizes, precisions, threads=threads,
                    optimizer=optimizer) + ".csv")
    status = [None]
    if dist.get_rank() == 0:
        status = [_measure(path, model, batches, loss_fn, len(batch_sizes), threads,
                           precisions, optimizer, {"model_fingerprint": fingerprint,
                                        "batch_sizes": ",".join(map(str, batch_sizes))})]
    dist.broadcast_object_list(status, src=0)  # the other ranks wait here
    if status[0]:
        raise QSyncError(f"cannot profile the model's ops ({status[0]}); its predicted step "
                         "falls back to the roofline")
    return path


def _measure(path: Path, model, batches, loss_fn, processes: int, threads: int,
             precisions: Sequence[str], optimizer: str, metadata: Mapping[str, str]) -> str:
    """Write the profile at ``path`` unless it exists; "" or what went wrong, in one line."""
    if path.exists():
        return ""
    try:
        frames = [profile_ops_concurrently(model, inputs, target, loss_fn, precisions,
                                           processes=processes, threads=threads,
                                           repeats=REPEATS, warmup=WARMUP,
                                           step_optimizer=optimizer,
                                           ddp_steps=sorted({"fp32", *precisions}),
                                           step_repeats=STEP_REPEATS)
                  for inputs, target in tqdm(batches.values(), desc="profile ops",
                                             unit="batch size")]
        inputs, target = next(iter(batches.values()))
        overheads = ddp_calibrated_metadata(
            frames, profiled_graph(model, inputs, target, loss_fn), optimizer)
    except Exception as err:  # it does not pickle, or its ops cannot be timed
        text = str(err).strip().splitlines()
        return f"{type(err).__name__}: {text[0] if text else ''}"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_profile(path, pd.concat(frames, ignore_index=True),
                  {**run_metadata("cpu", threads=threads), **metadata, **overheads})
    return ""
