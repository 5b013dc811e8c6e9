"""Profile ops the way the ranks will run them: several processes at once on one machine.

Local DDP ranks share the machine's caches and memory bandwidth. An op timed alone runs
with all of it; the same op inside a training step runs beside the other ranks' ops, and
memory-bound ops slow down. :func:`profile_ops_concurrently` starts ``processes`` spawned
processes that profile the same model at the same time (started together at a barrier,
each with ``threads`` intra-op threads), and keeps, per row, the median over the
processes.

Example::

    >>> import torch, torch.nn as nn
    >>> rows = profile_ops_concurrently(
    ...     nn.Sequential(nn.Linear(8, 8), nn.ReLU()), (torch.randn(4, 8),),
    ...     torch.randn(4, 8), nn.MSELoss(), ["fp32"], processes=2, repeats=2, warmup=0)
    >>> sorted(set(rows["phase"])), int(rows["repeats"].iloc[0])
    (['backward_input', 'backward_weight', 'forward'], 2)
"""

import multiprocessing
import queue
import statistics
from collections.abc import Sequence

import pandas as pd
from torch import nn

from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision

__all__ = ["median_over_processes", "profile_ops_concurrently"]

_POLL_S = 1.0


def profile_ops_concurrently(model: nn.Module, example_inputs: tuple, target, loss_fn: nn.Module,
                             precisions: Sequence["Precision | str"], *, processes: int = 2,
                             threads: int = 1, repeats: int = 10, warmup: int = 2,
                             device: str = "cpu", method: str = "in_step",
                             step_optimizer: str | None = None) -> pd.DataFrame:
    """:func:`~qsync_lab.profile.profile_ops` in ``processes`` processes at once; each row's
    ``time_us`` is the median over the processes (see the module docstring).

    ``step_optimizer``: each process then also times the whole training step with that
    optimizer (:func:`~qsync_lab.profile.overhead.time_training_step`); the median over the
    processes is ``rows.attrs["training_step_us"]``."""
    if processes < 1 or threads < 1:
        raise QSyncError(f"processes and threads must be positive, got {processes}, {threads}")
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(processes), context.Queue()
    args = (model, example_inputs, target, loss_fn, [str(Precision.parse(p)) for p in precisions],
            threads, repeats, warmup, device, method, step_optimizer, barrier, results)
    workers = [context.Process(target=_worker, args=(i, *args), daemon=True)
               for i in range(processes)]
    for worker in workers:
        worker.start()
    try:
        frames = [_next_result(results, workers) for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=_POLL_S)
            if worker.is_alive():
                worker.kill()
    errors = [f for f in frames if isinstance(f, str)]
    if errors:
        raise QSyncError(f"a profiling process failed: {errors[0]}")
    frames = sorted(frames, key=lambda f: f[0])
    rows = median_over_processes([rows for _, rows, _ in frames])
    if step_optimizer is not None:
        rows.attrs["training_step_us"] = statistics.median(step for _, _, step in frames)
    return rows


def median_over_processes(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """The rows of ``frames[0]``, each with the median ``time_us`` of the same row in every
    frame.

    Example::

        >>> a = pd.DataFrame({"op": ["x", "y"], "time_us": [1.0, 10.0]})
        >>> b = pd.DataFrame({"op": ["x", "y"], "time_us": [3.0, 30.0]})
        >>> median_over_processes([a, b])["time_us"].tolist()
        [2.0, 20.0]
    """
    keys = [c for c in frames[0].columns if c != "time_us"]
    medians = (pd.concat(frames, ignore_index=True)
               .groupby(keys, sort=False, dropna=False)["time_us"].median().reset_index())
    return frames[0].drop(columns="time_us").merge(medians, on=keys, how="left")[
        list(frames[0].columns)]


def _next_result(results, workers):
    """The next worker result; QSyncError if a worker died without sending one."""
    while True:
        try:
            return results.get(timeout=_POLL_S)
        except queue.Empty:
            dead = [w for w in workers if w.exitcode not in (None, 0)]
            if dead:
                raise QSyncError(f"a profiling process died (exit code {dead[0].exitcode}) "
                                 "before sending its rows; run the profile in one process "
                                 "to see its error") from None


def _worker(index, model, inputs, target, loss_fn, precisions, threads, repeats, warmup,
            device, method, step_optimizer, barrier, results) -> None:
    """One profiling process: wait for the others, profile, send (index, rows, training
    step µs or None) or an error."""
    from qsync_lab.profile.ops import profile_ops
    from qsync_lab.profile.overhead import time_training_step
    from qsync_lab.profile.timing import intra_op_threads

    try:
        with intra_op_threads(threads):
            barrier.wait()
            rows = profile_ops(model, inputs, target, loss_fn, precisions, repeats=repeats,
                               warmup=warmup, device=device, method=method, progress=False)
            step_us = None
            if step_optimizer is not None:
                barrier.wait()  # the steps are timed beside each other, as the ranks run
                step_us = time_training_step(model, inputs, target, loss_fn, step_optimizer,
                                             repeats=repeats, warmup=warmup)
        results.put((index, rows, step_us))
    except Exception as err:  # reported by the parent as a QSyncError
        barrier.abort()  # a process waiting for this one at a barrier fails too, not hangs
        results.put(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
