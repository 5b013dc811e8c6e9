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
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from torch import nn

from qsync_lab.errors import QSyncError
from qsync_lab.graph import TracingFallbackWarning
from qsync_lab.precision import Precision

__all__ = ["median_over_processes", "profile_ops_concurrently"]

_POLL_S = 1.0


def profile_ops_concurrently(model: nn.Module, example_inputs: tuple, target, loss_fn: nn.Module,
                             precisions: Sequence["Precision | str"], *, processes: int = 2,
                             threads: int = 1, repeats: int = 10, warmup: int = 2,
                             device: str = "cpu", method: str = "in_step",
                             step_optimizer: str | None = None,
                             ddp_steps: Sequence["Precision | str"] = (),
                             step_repeats: int | None = None) -> pd.DataFrame:
    """:func:`~qsync_lab.profile.profile_ops` in ``processes`` processes at once; each row's
    ``time_us`` is the median over the processes (see the module docstring); ``device``:
    where each process runs the ops (``cpu`` or ``cuda``).

    ``step_optimizer``: each process then also times the whole training step with that
    optimizer (:func:`~qsync_lab.profile.overhead.time_training_step`); the median over the
    processes is ``rows.attrs["training_step_us"]``. With ``ddp_steps`` (precisions) the
    processes instead form a gloo group and time the step as the ranks will take it, under
    DDP, with a uniform plan of each of those precisions
    (:func:`~qsync_lab.profile.overhead.time_ddp_training_steps`):
    ``rows.attrs["ddp_step_us"]`` (precision name -> median µs over the processes) and
    ``rows.attrs["ddp_processes"]``. Steps are the median of ``step_repeats`` (default
    ``repeats``)."""
    if processes < 1 or threads < 1:
        raise QSyncError(f"processes and threads must be positive, got {processes}, {threads}")
    if ddp_steps and step_optimizer is None:
        raise QSyncError("ddp_steps needs a step_optimizer (the optimizer the ranks will run)")
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(processes), context.Queue()
    steps = _StepTiming(step_optimizer, [str(Precision.parse(p)) for p in ddp_steps],
                        step_repeats or repeats, processes)
    with tempfile.TemporaryDirectory(prefix="qsync_profile_") as folder:
        args = (model, example_inputs, target, loss_fn,
                [str(Precision.parse(p)) for p in precisions], threads, repeats, warmup, device,
                method, steps, str(Path(folder) / "ddp_store"), barrier, results)
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
    timed = [step for _, _, step in frames]
    if steps.ddp_precisions:
        rows.attrs["ddp_step_us"] = {p: statistics.median(t[p] for t in timed)
                                     for p in steps.ddp_precisions}
        rows.attrs["ddp_processes"] = processes
    elif step_optimizer is not None:
        rows.attrs["training_step_us"] = statistics.median(timed)
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


@dataclass(frozen=True)
class _StepTiming:
    """Which whole training steps the profiling processes time (see
    :func:`profile_ops_concurrently`)."""

    optimizer: str | None
    ddp_precisions: list[str]
    repeats: int
    processes: int


def _worker(index, model, inputs, target, loss_fn, precisions, threads, repeats, warmup,
            device, method, steps: _StepTiming, ddp_store: str, barrier, results) -> None:
    """One profiling process: wait for the others, profile, send (index, rows, the timed
    training steps: µs, precision name -> µs under DDP, or None) or an error."""
    from qsync_lab.profile.ops import profile_ops
    from qsync_lab.profile.overhead import time_ddp_training_steps, time_training_step
    from qsync_lab.profile.timing import intra_op_threads

    warnings.simplefilter("ignore", TracingFallbackWarning)  # the parent's to give, once
    try:
        with intra_op_threads(threads):
            barrier.wait()
            rows = profile_ops(model, inputs, target, loss_fn, precisions, repeats=repeats,
                               warmup=warmup, device=device, method=method, progress=False)
            step_us = None
            if steps.optimizer is not None:
                barrier.wait()  # the steps are timed beside each other, as the ranks run
                if steps.ddp_precisions:
                    step_us = time_ddp_training_steps(
                        model, inputs, target, loss_fn, steps.optimizer, steps.ddp_precisions,
                        store=ddp_store, rank=index, world_size=steps.processes,
                        repeats=steps.repeats, warmup=warmup)
                else:
                    step_us = time_training_step(model, inputs, target, loss_fn,
                                                 steps.optimizer, repeats=steps.repeats,
                                                 warmup=warmup, device=device)
        results.put((index, rows, step_us))
    except Exception as err:  # reported by the parent as a QSyncError
        barrier.abort()  # a process waiting for this one at a barrier fails too, not hangs
        results.put(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
