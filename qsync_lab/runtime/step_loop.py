"""One rank's training steps, with the non-finite policy every rank applies alike.

:class:`StepLoop` runs the global steps from ``start`` to ``steps``. In each, the rank
takes its slice of the global batch (:class:`~qsync_lab.runtime.sampler.UnevenBatchSampler`)
and weights its loss by its share, so DDP's average is the gradient of the global batch;
then every rank gathers every rank's step time, loss and process peak RSS, rank 0 appends
a line to ``metrics.jsonl`` (:class:`~qsync_lab.runtime.metrics.MetricsLog`), and every
``checkpoint_every`` steps the run's state is saved (:mod:`qsync_lab.runtime.run_state`).

Non-finite values: a non-finite loss turns the rank's gradients to NaN, so DDP's own
allreduce carries it to every rank, which then all find a non-finite gradient before the
optimizer step (:func:`~qsync_lab.runtime.optimizer_step.finish_step`) and decide alike:
with ``on_nonfinite="stop"`` every rank raises :class:`~qsync_lab.errors.QSyncError`
naming the step and the loss (its ranks) or the first parameter found; with ``"skip"`` no
rank updates and the step is counted. A compression hook that meets a non-finite gradient
stops every rank, in one line naming the step.

Example::

    >>> process_peak_rss_bytes() > 0
    True
"""

import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

from qsync_lab.errors import QSyncError
from qsync_lab.quant.native import fp32_inputs
from qsync_lab.runtime.build import RankModel
from qsync_lab.runtime.memory import MemoryWindow
from qsync_lab.runtime.metrics import MetricsLog
from qsync_lab.runtime.optimizer_step import finish_step
from qsync_lab.runtime.outputs import METRICS
from qsync_lab.runtime.rank_context import RankContext
from qsync_lab.runtime.run_state import save_run_checkpoint
from qsync_lab.runtime.tasks import call_model, map_inputs

__all__ = ["MEMORY_STEPS", "StepLoop", "process_peak_rss_bytes"]

#: the steps of each attempt, after the model build, that the tensor memory peak covers
MEMORY_STEPS = 2


class StepLoop:
    """The steps of one rank from ``start`` (see the module docstring).

    After :meth:`run`, ``step_times`` holds this rank's step time of each step in ms and
    ``nonfinite_skipped`` the non-finite steps skipped so far (``nonfinite_skipped`` at
    ``start`` included).
    """

    def __init__(self, ctx: RankContext, model: RankModel, start: int,
                 nonfinite_skipped: int) -> None:
        self.ctx, self.model, self.start = ctx, model, start
        self.nonfinite_skipped = nonfinite_skipped
        self.step_times: list[float] = []

    def run(self, memory: MemoryWindow) -> None:
        """Run the steps; ``memory`` is closed after the first :data:`MEMORY_STEPS`."""
        ctx = self.ctx
        log = MetricsLog(ctx.run_dir / METRICS, resume_step=self.start) if ctx.rank == 0 else None
        try:
            with _progress(ctx.rank, self.start, ctx.config.steps) as progress:
                for step in range(self.start, ctx.config.steps):
                    step_ms, loss, nonfinite_gradient = self._step(step)
                    if step + 1 - self.start == MEMORY_STEPS:
                        memory.close()
                    self.step_times.append(step_ms)
                    ranks = self._gather(step_ms, loss)
                    nonfinite = (_nonfinite_cause(ranks[:, 1], nonfinite_gradient)
                                 if nonfinite_gradient is not None else None)
                    self._log(log, step, ranks, nonfinite)
                    if nonfinite is not None:
                        self._skip_or_stop(step, nonfinite)
                    progress.update(1)
                    if ctx.config.checkpoint_every and \
                            (step + 1) % ctx.config.checkpoint_every == 0:
                        save_run_checkpoint(ctx, self.model, step + 1, self.nonfinite_skipped)
        finally:
            if log is not None:
                log.close()

    def _step(self, step: int) -> tuple[float, float, str | None]:
        """One global step: this rank's step time in ms, its mean loss and the first
        parameter with a non-finite gradient (then the optimizer did not step; None: all
        finite)."""
        ctx, model = self.ctx, self.model
        index = ctx.sampler.indices(step, ctx.rank)
        inputs = map_inputs(ctx.task.train_inputs, lambda t: t[index].to(ctx.device))
        target = ctx.task.train_target[index].to(ctx.device)
        begin = time.perf_counter()
        model.optimizer.zero_grad()
        # the loss in fp32 (as autocast computes it), whatever dtype the last op wrote
        loss = ctx.loss_fn(fp32_inputs(None, (call_model(model.ddp, inputs),))[0], target)
        # a non-finite loss makes the gradients NaN: DDP's allreduce takes them to every rank
        weight = torch.where(torch.isfinite(loss.detach()), ctx.weight, math.nan).to(loss.dtype)
        try:
            model.loss_scale.scale(loss * weight).backward()
            if model.compression is not None:  # CUDA buckets mark non-finite gradients on
                model.compression.check_finite()  # the device: one read a step
        except RuntimeError:
            failure = model.compression.failure if model.compression is not None else None
            if isinstance(failure, QSyncError):  # a compression hook met a non-finite gradient
                raise QSyncError(f"step {step}: {failure}") from None
            raise
        except QSyncError as err:
            raise QSyncError(f"step {step}: {err}") from None
        nonfinite = finish_step(loss, model.optimizer, model.loss_scale, model.ddp.module)
        if ctx.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - begin) * 1e3, float(loss.detach()), nonfinite

    def _skip_or_stop(self, step: int, cause: str) -> None:
        """Every rank alike: count a skipped step or stop the run."""
        if self.ctx.config.on_nonfinite == "stop":
            raise QSyncError(f"non-finite {cause} at step {step}; every rank stopped (lower "
                             "--lr or check the data; --on-nonfinite skip skips such steps)")
        self.nonfinite_skipped += 1

    def _gather(self, step_ms: float, loss: float) -> torch.Tensor:
        """Every rank's (step time ms, loss, process peak RSS bytes), one row per rank."""
        mine = torch.tensor([step_ms, loss, float(process_peak_rss_bytes())],
                            dtype=torch.float64, device=self.ctx.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.ctx.world)]
        dist.all_gather(gathered, mine)  # on the rank's device: NCCL gathers CUDA tensors
        return torch.stack(gathered).cpu()

    def _log(self, log: MetricsLog | None, step: int, ranks: torch.Tensor,
             nonfinite: str | None) -> None:
        compression = self.model.compression
        telemetry = compression.telemetry() if compression is not None else None
        if log is None:
            return
        batch_sizes = self.ctx.batch_sizes
        slowest_ms = float(ranks[:, 0].max())
        global_loss = float(sum(b * ranks[r, 1] for r, b in enumerate(batch_sizes))
                            / sum(batch_sizes))
        record = {"step": step, "loss": global_loss,
                  "step_ms": [round(float(t), 4) for t in ranks[:, 0]],
                  "throughput_samples_per_s": sum(batch_sizes) / (slowest_ms / 1e3),
                  "process_peak_rss_mib": [round(float(m) / 2**20, 1) for m in ranks[:, 2]],
                  "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
        if nonfinite is not None:
            record["nonfinite"] = nonfinite
        if telemetry is not None:  # rank 0's: its own gradients' compression
            record["compression"] = telemetry
        log.write(record)


def process_peak_rss_bytes() -> int:
    """The process's peak resident set size (all memory, not only tensors), in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _progress(rank: int, start: int, steps: int):
    from tqdm.auto import tqdm

    return tqdm(total=steps, initial=start, desc="train", unit="step", disable=rank != 0,
                file=sys.stderr)


def _nonfinite_cause(losses: torch.Tensor, gradient: str) -> str:
    """What was non-finite: the loss (on which ranks), else the gradient of ``gradient``."""
    ranks = [str(r) for r, loss in enumerate(losses.tolist()) if not math.isfinite(loss)]
    return f"loss on rank {', '.join(ranks)}" if ranks else f"gradient of {gradient}"
