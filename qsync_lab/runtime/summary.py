"""The end of a run: what was measured beside what the simulator predicted.

:func:`finish` gathers every rank's figures (median step time after the warm-up, peak
tensor memory, process peak RSS, a digest of the final parameters) and on rank 0 evaluates
test accuracy (beside chance: the most frequent test label's share), predicts the same
plan and optimizer (:func:`~qsync_lab.runtime.prediction.predict_plan`), and writes the
final weights (``final.safetensors``, a checkpoint whose state is ``{"model":
state_dict}``) and ``summary.json``.

The warm-up left out of the median is ``warmup_steps``, by default a fifth of the steps
run and at least :data:`MIN_WARMUP_STEPS`, clipped so that at least one step is timed.

The prediction's costs for a CPU run include the model's own ops measured on this machine
before it trains (:func:`profile_model`): emulated kinds are costed as this host.
"""

import hashlib
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qsync_lab.costs import load_cost_model
from qsync_lab.errors import QSyncError
from qsync_lab.io import atomic_write_text
from qsync_lab.runtime.checkpoint import save_checkpoint
from qsync_lab.runtime.machine import emulated_kinds, emulated_on_cpu
from qsync_lab.runtime.metrics import strict_json
from qsync_lab.runtime.outputs import FINAL, SUMMARY
from qsync_lab.runtime.prediction import predict_plan, run_profiles
from qsync_lab.runtime.rank_context import RankContext
from qsync_lab.runtime.run_state import manifest
from qsync_lab.runtime.step_loop import StepLoop, process_peak_rss_bytes
from qsync_lab.runtime.tasks import call_model, map_inputs

__all__ = ["MIN_WARMUP_STEPS", "finish", "profile_model"]

MIN_WARMUP_STEPS = 3
_MIB = 2**20


def profile_model(ctx: RankContext) -> str | None:
    """The profile of the model's ops on this machine, timed before it trains for the
    prediction (cached; :mod:`qsync_lab.profile.model_cache`): a zoo model too, as the
    shipped profile was measured on another day's machine. None when profiles were
    given or the ranks run on CUDA (profile a GPU with ``qsync-lab profile --device
    cuda`` and pass it)."""
    if ctx.config.profiles or ctx.cuda:
        return None
    from qsync_lab.profile.model_cache import ranks_profile_model

    torch.manual_seed(ctx.config.seed)
    model = ctx.task.build_model()
    batches = {size: ctx.task.example(size) for size in dict.fromkeys(ctx.batch_sizes)}
    precisions = {"fp32", *(str(config.forward) for ops in ctx.plan.precisions.values()
                            for config in ops.values())}
    try:
        return str(ranks_profile_model(
            model, batches, ctx.task.loss_fn(), fingerprint=ctx.plan.model_fingerprint,
            batch_sizes=ctx.batch_sizes, precisions=sorted(precisions),
            optimizer=ctx.optimizer_name))
    except QSyncError as err:
        ctx.note(str(err))
        return None


def finish(loop: StepLoop, tensor_peak_bytes: int, model_profile: str | None) -> dict | None:
    """After the steps of ``loop``: rank 0 writes the final weights and ``summary.json``
    and returns the summary; the other ranks return None (a collective: every rank calls
    it). ``model_profile``: :func:`profile_model`'s."""
    ctx, ddp = loop.ctx, loop.model.ddp
    warmup = ctx.config.warmup_steps
    warmup = max(MIN_WARMUP_STEPS, len(loop.step_times) // 5) if warmup is None else warmup
    warmup = min(warmup, len(loop.step_times) - 1)  # at least one step is timed
    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                     for p in ddp.module.parameters())).hexdigest()[:16]
    mine = {"rank": ctx.rank, "kind": ctx.kind, "batch_size": ctx.batch_sizes[ctx.rank],
            "applied_plan": loop.model.applied,
            "median_step_ms": statistics.median(loop.step_times[warmup:]),
            "tensor_peak_bytes": tensor_peak_bytes,
            "process_peak_rss_bytes": process_peak_rss_bytes(), "params_sha256": digest}
    gathered = [None] * ctx.world
    dist.all_gather_object(gathered, mine)
    if ctx.rank != 0:
        return None
    summary = _summary(loop, gathered, warmup, model_profile)
    save_checkpoint(ctx.run_dir / FINAL, {"model": ddp.module.state_dict()},
                    manifest(ctx, ctx.config.steps))
    atomic_write_text(ctx.run_dir / SUMMARY, strict_json(summary, indent=1) + "\n")
    return summary


def _summary(loop: StepLoop, ranks: list[dict], warmup: int,
             model_profile: str | None) -> dict[str, Any]:
    ctx = loop.ctx
    accuracy, test_loss, chance = _evaluate(ctx, loop.model.ddp.module)
    profiles, costs = run_profiles(ctx.config.profiles, cuda=ctx.cuda), ctx.costs
    if model_profile:  # read first: its op rows win
        profiles = (model_profile, *profiles)
        costs = load_cost_model(*profiles)
    predicted = predict_plan(ctx.plan, loop.model.graph, costs, optimizer=ctx.optimizer_name,
                             on_cpu=not ctx.cuda)
    emulating = emulated_kinds(ctx.cluster if ctx.cuda else emulated_on_cpu(ctx.cluster))
    measured_ms = max(r["median_step_ms"] for r in ranks)
    predicted_ms = predicted.iteration_us / 1e3
    measured_mem = max(r["tensor_peak_bytes"] for r in ranks)
    predicted_mem = float(predicted.tensor_peak_bytes.max())
    return {
        "model": ctx.task.model_name or "user", "task": ctx.task.name,
        "cluster": ctx.cluster.name, "world_size": ctx.world,
        "backend": dist.get_backend(), "steps": ctx.config.steps, "resumed_from": loop.start,
        "test_accuracy": accuracy, "test_loss": test_loss, "chance_accuracy": chance,
        "measured_step_ms": measured_ms, "predicted_step_ms": predicted_ms,
        "step_error_pct": 100 * (predicted_ms - measured_ms) / measured_ms,
        "measured_tensor_peak_mib": measured_mem / _MIB,
        "predicted_tensor_peak_mib": predicted_mem / _MIB,
        "tensor_peak_error_pct": 100 * (predicted_mem - measured_mem) / measured_mem,
        "optimizer": ctx.optimizer_name,
        "nonfinite_steps_skipped": loop.nonfinite_skipped,
        "warmup_steps": warmup,
        "timed_steps": ctx.config.steps - loop.start - warmup,
        "prediction_costs": ", ".join(Path(p).name for p in profiles) or "catalog roofline",
        "emulating": list(emulating),
        "plan_made_under": ctx.plan.made_under(),
        "ranks": ranks,
    }


@torch.no_grad()
def _evaluate(ctx: RankContext,
              model: torch.nn.Module) -> tuple[float | None, float, float | None]:
    """Test accuracy (None: the model returns more than class scores), test loss and
    chance accuracy (the most frequent test label's share: what always guessing it
    scores; None with no accuracy)."""
    model.eval()
    inputs = map_inputs(ctx.task.test_inputs, lambda t: t.to(ctx.device))
    target = ctx.task.test_target.to(ctx.device)
    output = call_model(model, inputs)
    model.train()
    accuracy = chance = None  # a model returning more than class scores: the loss only
    if isinstance(output, torch.Tensor) and output.shape[:-1] == target.shape:
        accuracy = float((output.argmax(-1) == target).float().mean())
        chance = float(target.flatten().bincount().max()) / target.numel()
    return accuracy, float(ctx.loss_fn(output, target)), chance
