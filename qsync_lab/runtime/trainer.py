"""Train a plan under DDP: one call per rank, started by torchrun.

:func:`train` runs on every rank of ``torchrun … -m qsync_lab.runtime --plan plan.json``:

1. reads the plan and its cluster (world size, batch sizes, device kinds checked); the
   rank plays the device kind the plan gives it (``QSYNC_DEVICE_KIND`` overrides)
   (:mod:`~qsync_lab.runtime.rank_context`);
2. builds the model (seeded: identical on every rank), applies the kind's precisions as
   the simulator resolves them (:func:`~qsync_lab.quant.resolve.apply_resolved_plan_`),
   wraps it in DDP (gloo on CPU, NCCL on CUDA) with plain allreduce
   (:mod:`~qsync_lab.runtime.build`);
3. trains ``steps`` global steps: each rank takes its slice of the global batch
   (:class:`~qsync_lab.runtime.sampler.UnevenBatchSampler`) and weights its loss by its
   share (:func:`~qsync_lab.runtime.sampler.loss_weight`), so DDP's average is the
   gradient of the global batch whatever the per-rank batch sizes
   (:mod:`~qsync_lab.runtime.step_loop`);
4. every step checks the loss and the gradients: a non-finite loss turns the rank's
   gradients to NaN, so DDP's own allreduce carries it to every rank, which then all find
   a non-finite gradient before the optimizer step and decide alike: with
   ``on_nonfinite="stop"`` every rank raises :class:`~qsync_lab.errors.QSyncError` naming
   the step and the loss (its ranks) or the first parameter found; with ``"skip"`` no rank
   updates and the step is counted (``nonfinite_steps_skipped`` in the summary). On a GPU,
   a plan with fp16 gradients scales its loss (``torch.amp.GradScaler``, state in the
   checkpoints): a step whose gradients overflow is skipped and the scale halves;
5. rank 0 appends one line per step to ``metrics.jsonl`` (every rank's step time and
   process peak RSS so far, the global loss and throughput; strict JSON, a non-finite
   figure is null) and every ``checkpoint_every`` steps writes
   ``checkpoint-<step>.safetensors``, keeping the last ``keep_checkpoints``
   (:mod:`~qsync_lab.runtime.checkpoint`: tensors and JSON with a verified sha256, never
   a pickle). With ``resume`` a run continues exactly (same data, RNG states and rounding
   streams) from the newest checkpoint that verifies (a damaged newer one is reported in
   one line), which is what a torchrun restart does after a worker dies; it is refused,
   naming each difference, when the settings that define the run (seed, lr, momentum,
   optimizer, batches, world size, model, data and its sha256, compression, plan) are not
   the checkpoint's, does nothing when the checkpoint is already at ``steps``, and takes
   other ``steps``, ``checkpoint_every``, ... (:data:`~qsync_lab.runtime.options.SAFE_CHANGES`)
   only when ``allow_change`` names them (:mod:`~qsync_lab.runtime.run_state`). A run
   that starts at step 0 removes the checkpoints, summary and final weights an earlier run
   left in its folder, saying so, so that a later resume cannot continue that other run
   and a failed run leaves no other run's results beside its own;
6. at the end rank 0 evaluates test accuracy (beside chance: the most frequent test
   label's share) and writes ``summary.json``: measured median step time (after
   ``warmup_steps``, clipped so that at least one step is timed; the summary says how many
   were left out) and peak tensor memory beside the simulator's prediction for the same
   plan and optimizer (emulated kinds costed from the locally measured profile: on ranks
   without CUDA, or with ``emulate``, every GPU kind is emulated and the summary's
   ``emulating`` names them), what the plan was made under, and the final weights,
   ``final.safetensors`` (a checkpoint whose state is ``{"model": state_dict}``)
   (:mod:`~qsync_lab.runtime.summary`).

Before anything is written every rank refuses a symlinked output in the run folder
(:func:`~qsync_lab.runtime.outputs.check_outputs`); before the model's ops are timed
or the model built, a ``resume`` checks its checkpoint (a refusal, or a complete run, in
seconds: :func:`~qsync_lab.runtime.run_state.resume_point`); and before the model is
built a bad ``--profile``: no failure waits for the end of training.

The rank's process keeps the host memory it frees (:mod:`qsync_lab.hostmem`), as the
profiler's processes do: steady steps take no page faults, in the run and in the profile.

Peak tensor memory for the summary: on CUDA ``max_memory_allocated``; on the CPU,
torch.profiler memory events with c10's all-thread accounting over the model build and the
first :data:`~qsync_lab.runtime.step_loop.MEMORY_STEPS` steps of each attempt (the live
tensor bytes' maximum; :mod:`qsync_lab.runtime.memory`).
"""

import os
from typing import Any

import torch
import torch.distributed as dist

from qsync_lab.hostmem import keep_freed_memory
from qsync_lab.io import atomic_write_text
from qsync_lab.plan import Plan
from qsync_lab.runtime.build import build_rank
from qsync_lab.runtime.checkpoint import remove_partial_writes
from qsync_lab.runtime.gpu_share import backend_for
from qsync_lab.runtime.lock import lock_for_this_process
from qsync_lab.runtime.memory import MemoryWindow
from qsync_lab.runtime.options import TrainConfig
from qsync_lab.runtime.outputs import RANKS, check_outputs
from qsync_lab.runtime.rank_context import DEVICE_KIND_ENV, RankContext
from qsync_lab.runtime.run_state import (clear_earlier_run, complete_note, restore,
                                         resume_point)
from qsync_lab.runtime.step_loop import StepLoop
from qsync_lab.runtime.summary import finish, profile_model
from qsync_lab.runtime.tasks import Task

__all__ = ["DEVICE_KIND_ENV", "TrainConfig", "train"]


def train(config: TrainConfig, task: Task | None = None) -> dict[str, Any] | None:
    """Run ``config`` on this rank (see the module docstring); rank 0 returns the summary
    (None when a resumed run was already complete).

    ``task`` plugs in a user model and data (:class:`~qsync_lab.runtime.tasks.Task`);
    by default the plan's zoo model trains on its bundled task. The process group is
    created here (torchrun's environment) unless one exists.
    """
    keep_freed_memory()
    own_group = not dist.is_initialized()
    if own_group:
        _init_process_group(_backend(config))
    lock = lock_for_this_process(config.run_dir) if dist.get_rank() == 0 else None
    try:
        return _train_rank(RankContext(config, task))
    finally:
        if lock is not None:
            lock.release()
        if own_group:
            dist.destroy_process_group()


def _train_rank(ctx: RankContext) -> dict[str, Any] | None:
    """Check the run folder, build, restore, step and finish this rank's run."""
    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    check_outputs(ctx.run_dir)  # every rank, before anything is written
    if ctx.rank == 0:
        remove_partial_writes(ctx.run_dir)  # a writer killed mid-write
    _write_rank_file(ctx)
    point = resume_point(ctx)  # before anything is timed or built
    if point.step >= ctx.config.steps:
        ctx.note(complete_note(ctx.run_dir, point.step))
        return None
    if point.step == 0 and ctx.rank == 0:
        clear_earlier_run(ctx)
    model_profile = profile_model(ctx)
    memory = MemoryWindow(ctx.cuda)  # model build + the first MEMORY_STEPS steps
    try:
        model = build_rank(ctx)
        loop = StepLoop(ctx, model, point.step, restore(ctx, model, point))
        loop.run(memory)
    finally:
        memory.close()
    return finish(loop, memory.peak_bytes, model_profile)


def _init_process_group(backend: str) -> None:
    """The default group from torchrun's environment, its store keys prefixed by the restart
    count: after a restart, torchrun's store still holds the dead attempt's addresses under
    the default keys, and connecting to them fails ("Connection refused")."""
    store, rank, world = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"qsync_lab/attempt{attempt}", store),
                            rank=rank, world_size=world)


def _backend(config: TrainConfig) -> str:
    """NCCL for CUDA ranks with a GPU each; gloo on the CPU and where the ranks of this node
    share a GPU (:func:`~qsync_lab.runtime.gpu_share.backend_for`)."""
    if config.emulate or not torch.cuda.is_available():
        return "gloo"
    ranks = Plan.load(config.plan).cluster.ranks
    node = ranks[int(os.environ.get("RANK", "0"))].node
    return backend_for([r.gpu_index for r in ranks if r.node == node], cuda=True)


def _write_rank_file(ctx: RankContext) -> None:
    """``ranks/rank<N>.json``: this rank's pid, device kind and torchrun attempt."""
    atomic_write_text(ctx.run_dir / RANKS / f"rank{ctx.rank}.json",
                      f'{{"pid": {os.getpid()}, "kind": "{ctx.kind}", "attempt": '
                      f'{os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}}}\n',
                      within=ctx.run_dir)
