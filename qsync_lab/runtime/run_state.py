"""A run's state in its checkpoints: what every ``checkpoint_every`` steps saves, and what
``--resume`` restores.

:func:`save_run_checkpoint` gathers every rank's own state (RNG states, rounding counters,
compression and loss-scaler state) beside the model and optimizer, and rank 0 writes it as
``checkpoint-<step>.safetensors`` (:mod:`~qsync_lab.runtime.checkpoint`), keeping the last
``keep_checkpoints``. A resumed run continues from the newest checkpoint that verifies,
exactly. :func:`resume_point` checks it first, before the rank times or builds anything
(and :func:`launch_resume_point`, the same check in the launcher, before any rank starts):
it refuses a checkpoint whose run differs in a setting that defines the run (each
difference named), takes a change of a safe option
(:data:`~qsync_lab.runtime.options.SAFE_CHANGES`) only when ``allow_change`` names it, and
finds a complete run complete. :func:`restore` then loads the checkpoint's state into the
built model (reading it again, inside the run's memory window, as a fresh start's
tensors are).
"""

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from qsync_lab.errors import QSyncError
from qsync_lab.plan import Plan
from qsync_lab.quant import restore_rounding_counters, rounding_counters
from qsync_lab.runtime.build import RankModel
from qsync_lab.runtime.checkpoint import (Checkpoint, capture_rng_state, checkpoint_path,
                                          latest_valid_checkpoint, load_checkpoint,
                                          prune_checkpoints, restore_rng_state,
                                          save_checkpoint, settings_differences)
from qsync_lab.runtime.options import SAFE_CHANGES, TrainConfig, option_name
from qsync_lab.runtime.outputs import FINAL, METRICS, SUMMARY, saved_checkpoints
from qsync_lab.runtime.rank_context import RankContext, run_settings, zoo_task

__all__ = ["ResumePoint", "checked_resume", "clear_earlier_run", "complete_note",
           "launch_resume_point", "manifest", "restore", "resume_point", "save_run_checkpoint"]

#: what restoring a checkpoint's state raises when it is not this run's (entries missing or
#: of another kind or shape: a file that verifies may still be made by hand)
_STATE_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError)


def manifest(ctx: RankContext, step: int) -> dict[str, Any]:
    """A checkpoint's manifest: its step and the run's settings."""
    return {"step": step, "settings": ctx.settings}


def save_run_checkpoint(ctx: RankContext, model: RankModel, step: int,
                        nonfinite_skipped: int) -> None:
    """Save the run's state after ``step`` steps (a collective: every rank calls it)."""
    mine = {"rng": capture_rng_state(), "rounding": rounding_counters(model.ddp.module),
            "compression": (model.compression.state_dict()
                            if model.compression is not None else None),
            "loss_scale": (model.loss_scale.state_dict()
                           if model.loss_scale.is_enabled() else None)}
    gathered = [None] * ctx.world
    dist.all_gather_object(gathered, mine)
    if ctx.rank == 0:
        save_checkpoint(checkpoint_path(ctx.run_dir, step), {
            "model": model.ddp.module.state_dict(), "optimizer": model.optimizer.state_dict(),
            "ranks": gathered, "nonfinite_steps_skipped": nonfinite_skipped},
            manifest(ctx, step))
        prune_checkpoints(ctx.run_dir, step, ctx.config.keep_checkpoints)


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where a run starts: :func:`resume_point`'s answer."""

    step: int  #: the steps already done (0: a fresh start)
    checkpoint: Path | None  #: the checkpoint whose state to load (None: none to load)


def resume_point(ctx: RankContext) -> ResumePoint:
    """Where this run starts: step 0 without ``resume`` or a checkpoint, else the newest
    valid checkpoint, checked against this run's settings (:func:`checked_resume`).

    Raises:
        QSyncError: the checkpoint is not this run's, or changes a setting unasked; one line.
    """
    if not ctx.config.resume:
        return ResumePoint(0, None)
    saved = latest_valid_checkpoint(ctx.run_dir, warn=ctx.note)
    if saved is None:
        if (ctx.run_dir / METRICS).exists():  # an earlier attempt saved nothing
            ctx.note(f"--resume: no checkpoint in {ctx.run_dir} (none was written yet, "
                     "or --checkpoint-every 0); starting from step 0")
        return ResumePoint(0, None)
    return checked_resume(saved, ctx.settings, ctx.config)


def launch_resume_point(config: TrainConfig, plan: Plan,
                        warn: Callable[[str], None]) -> ResumePoint:
    """:func:`resume_point` answered by the launcher before any rank starts, on the same
    settings (:func:`~qsync_lab.runtime.rank_context.run_settings` of the plan's zoo task),
    so that a refused or complete resume costs no process; the ranks check again.

    Raises:
        QSyncError: as :func:`resume_point`.
    """
    saved = latest_valid_checkpoint(config.run_dir, warn=warn) if config.resume else None
    if saved is None:
        return ResumePoint(0, None)
    return checked_resume(saved, run_settings(config, plan, zoo_task(config, plan)), config)


def checked_resume(saved: Checkpoint, settings: dict[str, Any],
                   config: TrainConfig) -> ResumePoint:
    """Where a run of ``settings`` resumes from checkpoint ``saved``: its step, with the
    checkpoint to load unless the run is already complete (the step at ``config.steps`` or
    beyond).

    Raises:
        QSyncError: ``saved`` is another run's (the differences named), or it changes a safe
            option that ``config.allow_change`` does not name; one line.
    """
    changed = _changes(saved, settings, [name for name in settings if name not in SAFE_CHANGES])
    if changed:
        raise QSyncError(f"--resume: this run differs from its checkpoint in: "
                         f"{_listed(changed)}; start a fresh --run-dir")
    if saved.step >= config.steps:
        return ResumePoint(saved.step, None)
    changed = _changes(saved, settings, [name for name in SAFE_CHANGES
                                         if name not in config.allow_change])
    if changed:
        raise QSyncError(f"--resume: this run changes {_listed(changed)} from its "
                         f"checkpoint; pass --allow-change "
                         f"{','.join(map(option_name, changed))} to go on so, or resume "
                         "with the checkpoint's values")
    return ResumePoint(saved.step, saved.path)


def complete_note(run_dir: Path, step: int) -> str:
    """What a resume of a run complete at ``step`` says (and that its summary is missing,
    when it is)."""
    missing = "" if (run_dir / SUMMARY).exists() else (
        f" (its {SUMMARY} is missing: the run stopped before writing it; {METRICS} has its "
        "steps)")
    return f"run already complete at step {step}; nothing to do{missing}"


def clear_earlier_run(ctx: RankContext) -> None:
    """On rank 0 of a run that starts at step 0: remove what an earlier run left in the
    folder, saying so: its checkpoints (a later ``--resume`` would continue that run, or
    find it complete), its summary and final weights (a run that fails would leave them
    beside its own metrics, as if they were its results)."""
    steps = sorted(step for step, _ in saved_checkpoints(ctx.run_dir))
    removed = [f"checkpoints (steps {', '.join(map(str, steps))})"] if steps else []
    if steps:
        prune_checkpoints(ctx.run_dir, 0, ctx.config.keep_checkpoints)
    for name in (SUMMARY, FINAL):
        if (ctx.run_dir / name).is_file():
            (ctx.run_dir / name).unlink()
            removed.append(name)
    if removed:
        listed = ", ".join(removed[:-1]) + " and " + removed[-1] if len(removed) > 1 else removed[0]
        ctx.note(f"a fresh run in {ctx.run_dir}: removed the earlier run's {listed}; --resume "
                 "continues a run instead")


def restore(ctx: RankContext, model: RankModel, point: ResumePoint) -> int:
    """Load ``point``'s checkpoint state into this rank's built model (nothing without
    one); the non-finite steps skipped so far.

    Raises:
        QSyncError: the state, which verifies, is not this run's; one line.
    """
    return 0 if point.checkpoint is None else _load_state(ctx, model,
                                                          load_checkpoint(point.checkpoint))


def _changes(saved: Checkpoint, settings: dict[str, Any], names: list[str]) -> dict[str, str]:
    """The ``settings`` of ``names`` that differ from the checkpoint's."""
    return settings_differences(saved.manifest.get("settings", {}),
                                {name: settings[name] for name in names})


def _load_state(ctx: RankContext, model: RankModel, saved: Checkpoint) -> int:
    """Put the checkpoint's state (a :func:`save_run_checkpoint`'s) back in this rank; the
    non-finite steps it had skipped.

    Raises:
        QSyncError: the state, which verifies, is not this run's (entries missing or of
            another kind or shape); one line.
    """
    state = saved.state
    try:
        mine = state["ranks"][ctx.rank]
        model.ddp.module.load_state_dict(state["model"])
        model.optimizer.load_state_dict(state["optimizer"])
        restore_rounding_counters(model.ddp.module, mine["rounding"])
        if model.compression is not None:
            model.compression.load_state_dict(mine["compression"])
        if model.loss_scale.is_enabled():
            model.loss_scale.load_state_dict(mine["loss_scale"])
        restore_rng_state(mine["rng"])
        return int(state["nonfinite_steps_skipped"])
    except _STATE_ERRORS as err:
        raise QSyncError(f"{saved.path} verifies but does not hold this run's state "
                         f"({_described(err)}); start a fresh --run-dir") from None


def _listed(changes: dict[str, str]) -> str:
    """``{"seed": "0 -> 1"}`` as ``seed 0 -> 1``, comma-separated."""
    return ", ".join(f"{name} {change}" for name, change in changes.items())


def _described(err: Exception) -> str:
    """``KeyError: 'ranks'``: the error's type and the first line of its message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
