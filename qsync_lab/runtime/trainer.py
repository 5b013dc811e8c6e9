"""Train a plan under DDP: one call per rank, started by torchrun.

:func:`train` runs on every rank of ``torchrun … -m qsync_lab.runtime --plan plan.json``:

1. reads the plan and its cluster (world size, batch sizes, device kinds checked); the
   rank plays the device kind the plan gives it (``QSYNC_DEVICE_KIND`` overrides);
2. builds the model (seeded: identical on every rank), applies the kind's precisions as
   the simulator resolves them (:func:`~qsync_lab.quant.resolve.apply_resolved_plan_`),
   wraps it in DDP (gloo on CPU, NCCL on CUDA) with plain allreduce;
3. trains ``steps`` global steps: each rank takes its slice of the global batch
   (:class:`~qsync_lab.runtime.sampler.UnevenBatchSampler`) and weights its loss by its
   share (:func:`~qsync_lab.runtime.sampler.loss_weight`), so DDP's average is the
   gradient of the global batch whatever the per-rank batch sizes;
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
   only when ``allow_change`` names them;
6. at the end rank 0 evaluates test accuracy (beside chance: the most frequent test
   label's share) and writes ``summary.json``: measured median step time (after
   ``warmup_steps``, clipped so that at least one step is timed; the summary says how many
   were left out) and peak tensor memory beside the simulator's prediction for the same
   plan and optimizer (emulated kinds costed from the locally measured profile: on ranks
   without CUDA, or with ``emulate``, every GPU kind is emulated and the summary's
   ``emulating`` names them), what the plan was made under, and the final weights,
   ``final.safetensors`` (a checkpoint whose state is ``{"model": state_dict}``).

Before anything is written every rank refuses a symlinked output in the run folder
(:func:`~qsync_lab.runtime.outputs.check_outputs`), and before the model is built a bad
``--profile``: no failure waits for the end of training.

The rank's process keeps the host memory it frees (:mod:`qsync_lab.hostmem`), as the
profiler's processes do: steady steps take no page faults, in the run and in the profile.

Peak tensor memory for the summary: on CUDA ``max_memory_allocated``; on the CPU,
torch.profiler memory events with c10's all-thread accounting over the model build and the
first ``MEMORY_STEPS`` steps of each attempt (the live tensor bytes' maximum;
:mod:`qsync_lab.runtime.memory`).
"""

import hashlib
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from qsync_lab.costs import load_cost_model
from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph
from qsync_lab.hostmem import keep_freed_memory
from qsync_lab.io import atomic_write_text
from qsync_lab.optimizers import make_optimizer
from qsync_lab.plan import Plan
from qsync_lab.quant import apply_resolved_plan_, restore_rounding_counters, rounding_counters
from qsync_lab.quant.native import fp32_inputs
from qsync_lab.runtime.checkpoint import (Checkpoint, capture_rng_state, checkpoint_path,
                                          latest_valid_checkpoint, prune_checkpoints,
                                          remove_partial_writes, restore_rng_state,
                                          save_checkpoint, settings_differences)
from qsync_lab.runtime.agreement import check_ranks_agree
from qsync_lab.runtime.gpu_share import backend_for, enter_sm_partition
from qsync_lab.runtime.lock import lock_for_this_process
from qsync_lab.runtime.machine import emulated_kinds, emulated_on_cpu
from qsync_lab.runtime.memory import MemoryWindow
from qsync_lab.runtime.metrics import MetricsLog, strict_json
from qsync_lab.runtime.options import SAFE_CHANGES, TrainConfig, option_name
from qsync_lab.runtime.optimizer_step import finish_step, loss_scaler
from qsync_lab.runtime.outputs import FINAL, METRICS, RANKS, SUMMARY, check_outputs
from qsync_lab.runtime.prediction import run_profiles
from qsync_lab.runtime.sampler import UnevenBatchSampler, loss_weight
from qsync_lab.runtime.tasks import Task, call_model, default_task, load_task, map_inputs

__all__ = ["DEVICE_KIND_ENV", "TrainConfig", "train"]

DEVICE_KIND_ENV = "QSYNC_DEVICE_KIND"
MEMORY_STEPS = 2
MIN_WARMUP_STEPS = 3
_MIB = 2**20
#: options every rank must share besides the run's settings (a rank that resumes alone, or
#: refuses a resume the others allow, would leave the others waiting in a collective)
_SHARED_OPTIONS = ("resume", "allow_change")
#: what restoring a checkpoint's state raises when it is not this run's (entries missing or
#: of another kind or shape: a file that verifies may still be made by hand)
_STATE_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError)


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
        return _Run(config, task).train()
    finally:
        if lock is not None:
            lock.release()
        if own_group:
            dist.destroy_process_group()


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


class _Run:
    """One rank's training run (state shared by the steps of :func:`train`)."""

    def __init__(self, config: TrainConfig, task: Task | None) -> None:
        self.config = config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.run_dir = Path(config.run_dir)
        self.cuda = torch.cuda.is_available() and not config.emulate
        self.plan = Plan.load(config.plan)
        self.cluster = self.plan.cluster
        if self.plan.world_size != self.world:
            raise QSyncError(f"the plan's cluster {self.cluster.name!r} has "
                             f"{self.plan.world_size} ranks but torchrun started {self.world}; "
                             f"use --nproc-per-node={self.plan.world_size} (or re-plan)")
        me = self.cluster.ranks[self.rank]  # a RankSpec: its GPU and SMs (the plan's has none)
        self.device = torch.device("cuda", me.gpu_index) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)
            if me.sms is not None:  # before any other CUDA work: every stream on its SMs
                peers = [r for r in self.cluster.ranks if r.sms is not None
                         and (r.node, r.gpu_index) == (me.node, me.gpu_index)]
                enter_sm_partition([r.sms for r in peers], peers.index(me), self.device.index)
            # fp32 ops compute in fp32; tf32 ops switch TF32 on around themselves
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        if config.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        # the prediction's costs, read now: a bad --profile fails before training, not after
        self.costs = load_cost_model(*run_profiles(config.profiles, cuda=self.cuda))
        self.optimizer_name = config.optimizer or self.plan.optimizer
        self.kind = os.environ.get(DEVICE_KIND_ENV) or self.plan.ranks[self.rank].device
        if self.kind not in self.plan.precisions:
            raise QSyncError(f"{DEVICE_KIND_ENV}={self.kind!r} is not a device kind of the plan "
                             f"({', '.join(self.plan.precisions)})")
        self.task = task if task is not None else self._zoo_task()
        self.batch_sizes = self.plan.batch_sizes
        self.sampler = UnevenBatchSampler(self.task.num_train, self.batch_sizes, config.seed)
        self.weight = loss_weight(self.batch_sizes, self.rank)
        self.loss_fn = self.task.loss_fn()
        if config.on_nonfinite == "skip" and self.plan.compression_settings:
            raise QSyncError("--on-nonfinite skip does not work with gradient compression (its "
                             "hooks stop every rank at a non-finite gradient); use "
                             "--on-nonfinite stop or a plan without compression")
        self.settings = self._settings()
        self.nonfinite_skipped = 0

    def _settings(self) -> dict[str, Any]:
        """What makes this run this run, then the options a resume may change only when
        ``allow_change`` names them (:data:`~qsync_lab.runtime.options.SAFE_CHANGES`)."""
        plan = self.plan.to_dict()
        defining = {
            "seed": self.config.seed, "lr": self.config.lr, "momentum": self.config.momentum,
            "optimizer": self.optimizer_name, "batch_sizes": list(self.batch_sizes),
            "world_size": self.world, "model": self.task.model_name,
            "model_kwargs": self.task.model_kwargs, "data": self.task.name,
            "data_sha256": _data_sha256(self.task),
            "compression": plan["_data"]["compression"],
            "plan": hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()}
        return {**defining, **{name: getattr(self.config, name) for name in SAFE_CHANGES}}

    def _identity(self) -> dict[str, str]:
        """What every rank must share, one field each, so that a difference is named
        (:func:`~qsync_lab.runtime.agreement.check_ranks_agree`): the plan, the model built,
        the cluster, every setting (the data's sha256 among them) and the options."""
        fields = {"plan": self.settings["plan"], "model_graph": self.graph.fingerprint(),
                  "cluster": self.cluster.fingerprint(), **self.settings,
                  **{name: getattr(self.config, name) for name in _SHARED_OPTIONS}}
        return {name: json.dumps(value, sort_keys=True) for name, value in fields.items()}

    def _note(self, line: str) -> None:
        """One line on rank 0's stderr, marked ``qsync_lab:`` (``qsync-lab run`` shows
        such lines from the ranks' log)."""
        if self.rank == 0:
            print(f"qsync_lab: {line}", file=sys.stderr)

    def _zoo_task(self) -> Task:
        model = self.config.model or self.plan.model_name
        if not model:
            raise QSyncError("the plan names no model; pass --model (a zoo model)")
        kwargs = (self.config.model_kwargs if self.config.model_kwargs is not None
                  else dict(self.plan.model_kwargs))
        return load_task(self.config.data or default_task(model), model,
                         seed=self.config.seed, **kwargs)

    def _profile_model(self) -> str | None:
        """The profile of the model's ops on this machine, timed before it trains for the
        prediction (cached; :mod:`qsync_lab.profile.model_cache`): a zoo model too, as the
        shipped profile was measured on another day's machine. None when profiles were
        given or the ranks run on CUDA (profile a GPU with ``qsync-lab profile --device
        cuda`` and pass it)."""
        if self.config.profiles or self.cuda:
            return None
        from qsync_lab.profile.model_cache import ranks_profile_model

        torch.manual_seed(self.config.seed)
        model = self.task.build_model()
        batches = {size: self.task.example(size) for size in dict.fromkeys(self.batch_sizes)}
        precisions = {"fp32", *(str(config.forward) for ops in self.plan.precisions.values()
                                for config in ops.values())}
        try:
            return str(ranks_profile_model(
                model, batches, self.task.loss_fn(), fingerprint=self.plan.model_fingerprint,
                batch_sizes=self.batch_sizes, precisions=sorted(precisions),
                optimizer=self.optimizer_name))
        except QSyncError as err:
            self._note(str(err))
            return None

    def _build(self):
        torch.manual_seed(self.config.seed)
        model = self.task.build_model()
        inputs, target = self.task.example(self.batch_sizes[self.rank])
        graph = trace_graph(model, inputs, target=target, loss_fn=self.task.loss_fn())
        self.graph = graph
        check_ranks_agree(self._identity())  # before any check one rank alone could fail
        self.plan.validate(graph, self.cluster)  # and before DDP's or the hooks' collectives
        device_spec = self.cluster.catalog.device(self.kind)
        self.applied = apply_resolved_plan_(model, graph, self.plan.precisions[self.kind],
                                             device_spec)
        model = model.to(self.device)
        self.ddp = DistributedDataParallel(model, device_ids=[self.device] if self.cuda else None)
        self.compression = None
        if self.plan.compression_settings:
            from qsync_lab.compress import register_compression

            self.compression = register_compression(self.ddp, self.plan.compression_settings,
                                                    seed=self.config.seed)
        self.optimizer = make_optimizer(self.optimizer_name, self.ddp.parameters(),
                                        lr=self.config.lr, momentum=self.config.momentum)
        self.loss_scale = loss_scaler(model, cuda=self.cuda)

    def _restore(self) -> int:
        """Continue from the newest valid checkpoint (with ``resume``); the step reached."""
        if not self.config.resume:
            return 0
        saved = latest_valid_checkpoint(self.run_dir, warn=self._note)
        if saved is None:
            if (self.run_dir / METRICS).exists():  # an earlier attempt saved nothing
                self._note(f"--resume: no checkpoint in {self.run_dir} (none was written yet, "
                           "or --checkpoint-every 0); starting from step 0")
            return 0
        changed = self._changes(saved, [name for name in self.settings
                                        if name not in SAFE_CHANGES])
        if changed:
            raise QSyncError(f"--resume: this run differs from its checkpoint in: "
                             f"{_listed(changed)}; start a fresh --run-dir")
        if saved.step >= self.config.steps:
            return saved.step
        changed = self._changes(saved, [name for name in SAFE_CHANGES
                                        if name not in self.config.allow_change])
        if changed:
            raise QSyncError(f"--resume: this run changes {_listed(changed)} from its "
                             f"checkpoint; pass --allow-change "
                             f"{','.join(map(option_name, changed))} to go on so, or resume "
                             "with the checkpoint's values")
        self._load_state(saved)
        return saved.step

    def _changes(self, saved: Checkpoint, names: list[str]) -> dict[str, str]:
        """The settings of ``names`` that differ from the checkpoint's."""
        return settings_differences(saved.manifest.get("settings", {}),
                                    {name: self.settings[name] for name in names})

    def _load_state(self, saved: Checkpoint) -> None:
        """Put the checkpoint's state (a :meth:`_checkpoint`'s) back in this rank.

        Raises:
            QSyncError: the state, which verifies, is not this run's (entries missing or of
                another kind or shape); one line.
        """
        state = saved.state
        try:
            mine = state["ranks"][self.rank]
            self.ddp.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            restore_rounding_counters(self.ddp.module, mine["rounding"])
            if self.compression is not None:
                self.compression.load_state_dict(mine["compression"])
            if self.loss_scale.is_enabled():
                self.loss_scale.load_state_dict(mine["loss_scale"])
            restore_rng_state(mine["rng"])
            self.nonfinite_skipped = int(state["nonfinite_steps_skipped"])
        except _STATE_ERRORS as err:
            raise QSyncError(f"{saved.path} verifies but does not hold this run's state "
                             f"({_described(err)}); start a fresh --run-dir") from None

    def _checkpoint(self, step: int) -> None:
        mine = {"rng": capture_rng_state(), "rounding": rounding_counters(self.ddp.module),
                "compression": (self.compression.state_dict()
                                if self.compression is not None else None),
                "loss_scale": (self.loss_scale.state_dict()
                               if self.loss_scale.is_enabled() else None)}
        gathered = [None] * self.world
        dist.all_gather_object(gathered, mine)
        if self.rank == 0:
            save_checkpoint(checkpoint_path(self.run_dir, step), {
                "model": self.ddp.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "ranks": gathered, "nonfinite_steps_skipped": self.nonfinite_skipped},
                self._manifest(step))
            prune_checkpoints(self.run_dir, step, self.config.keep_checkpoints)

    def _manifest(self, step: int) -> dict[str, Any]:
        return {"step": step, "settings": self.settings}

    def _step(self, step: int) -> tuple[float, float, str | None]:
        """One global step: this rank's step time in ms, its mean loss and the first
        parameter with a non-finite gradient (then the optimizer did not step; None: all
        finite)."""
        index = self.sampler.indices(step, self.rank)
        inputs = map_inputs(self.task.train_inputs, lambda t: t[index].to(self.device))
        target = self.task.train_target[index].to(self.device)
        begin = time.perf_counter()
        self.optimizer.zero_grad()
        # the loss in fp32 (as autocast computes it), whatever dtype the last op wrote
        loss = self.loss_fn(fp32_inputs(None, (call_model(self.ddp, inputs),))[0], target)
        # a non-finite loss makes the gradients NaN: DDP's allreduce takes them to every rank
        weight = torch.where(torch.isfinite(loss.detach()), self.weight, math.nan).to(loss.dtype)
        try:
            self.loss_scale.scale(loss * weight).backward()
            if self.compression is not None:  # CUDA buckets mark non-finite gradients on
                self.compression.check_finite()  # the device: one read a step
        except RuntimeError:
            failure = self.compression.failure if self.compression is not None else None
            if isinstance(failure, QSyncError):  # a compression hook met a non-finite gradient
                raise QSyncError(f"step {step}: {failure}") from None
            raise
        except QSyncError as err:
            raise QSyncError(f"step {step}: {err}") from None
        nonfinite = finish_step(loss, self.optimizer, self.loss_scale, self.ddp.module)
        if self.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - begin) * 1e3, float(loss.detach()), nonfinite

    def train(self) -> dict[str, Any] | None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        check_outputs(self.run_dir)  # every rank, before anything is written
        if self.rank == 0:
            remove_partial_writes(self.run_dir)  # a writer killed mid-write
        self._write_rank_file()
        self.model_profile = self._profile_model()
        memory = MemoryWindow(self.cuda)  # model build + the first MEMORY_STEPS steps
        step_times: list[float] = []
        log = None
        try:
            self._build()
            start = self._restore()
            if start >= self.config.steps:
                missing = "" if (self.run_dir / SUMMARY).exists() else (
                    f" (its {SUMMARY} is missing: the run stopped before writing it; "
                    f"{METRICS} has its steps)")
                self._note(f"run already complete at step {start}; nothing to do{missing}")
                return None
            if self.rank == 0:
                log = MetricsLog(self.run_dir / METRICS, resume_step=start)
            with _progress(self.rank, start, self.config.steps) as progress:
                for step in range(start, self.config.steps):
                    step_ms, loss, nonfinite_gradient = self._step(step)
                    if step + 1 - start == MEMORY_STEPS:
                        memory.close()
                    step_times.append(step_ms)
                    ranks = self._gather(step_ms, loss)
                    nonfinite = (_nonfinite_cause(ranks[:, 1], nonfinite_gradient)
                                 if nonfinite_gradient is not None else None)
                    self._log(log, step, ranks, nonfinite)
                    if nonfinite is not None:
                        self._skip_or_stop(step, nonfinite)
                    progress.update(1)
                    if self.config.checkpoint_every and \
                            (step + 1) % self.config.checkpoint_every == 0:
                        self._checkpoint(step + 1)
        finally:
            memory.close()
            if log is not None:
                log.close()
        return self._finish(step_times, memory.peak_bytes, start)

    def _skip_or_stop(self, step: int, cause: str) -> None:
        """Every rank alike: count a skipped step or stop the run."""
        if self.config.on_nonfinite == "stop":
            raise QSyncError(f"non-finite {cause} at step {step}; every rank stopped (lower "
                             "--lr or check the data; --on-nonfinite skip skips such steps)")
        self.nonfinite_skipped += 1

    def _gather(self, step_ms: float, loss: float) -> torch.Tensor:
        """Every rank's (step time ms, loss, process peak RSS bytes), one row per rank."""
        mine = torch.tensor([step_ms, loss, float(_process_peak_rss_bytes())],
                            dtype=torch.float64, device=self.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)  # on the rank's device: NCCL gathers CUDA tensors
        return torch.stack(gathered).cpu()

    def _log(self, log: MetricsLog | None, step: int, ranks: torch.Tensor,
             nonfinite: str | None) -> None:
        telemetry = self.compression.telemetry() if self.compression is not None else None
        if log is None:
            return
        slowest_ms = float(ranks[:, 0].max())
        global_loss = float(sum(b * ranks[r, 1] for r, b in enumerate(self.batch_sizes))
                            / sum(self.batch_sizes))
        record = {"step": step, "loss": global_loss,
                  "step_ms": [round(float(t), 4) for t in ranks[:, 0]],
                  "throughput_samples_per_s": sum(self.batch_sizes) / (slowest_ms / 1e3),
                  "process_peak_rss_mib": [round(float(m) / _MIB, 1) for m in ranks[:, 2]],
                  "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
        if nonfinite is not None:
            record["nonfinite"] = nonfinite
        if telemetry is not None:  # rank 0's: its own gradients' compression
            record["compression"] = telemetry
        log.write(record)

    def _write_rank_file(self) -> None:
        atomic_write_text(self.run_dir / RANKS / f"rank{self.rank}.json",
                          f'{{"pid": {os.getpid()}, "kind": "{self.kind}", "attempt": '
                          f'{os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}}}\n',
                          within=self.run_dir)

    def _finish(self, step_times: list[float], tensor_peak: int, start: int) -> dict | None:
        warmup = self.config.warmup_steps
        warmup = max(MIN_WARMUP_STEPS, len(step_times) // 5) if warmup is None else warmup
        self.warmup_used = min(warmup, len(step_times) - 1)  # at least one step is timed
        timed = step_times[self.warmup_used:]
        digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                         for p in self.ddp.module.parameters())).hexdigest()[:16]
        mine = {"rank": self.rank, "kind": self.kind, "batch_size": self.batch_sizes[self.rank],
                "applied_plan": self.applied, "median_step_ms": statistics.median(timed),
                "tensor_peak_bytes": tensor_peak,
                "process_peak_rss_bytes": _process_peak_rss_bytes(), "params_sha256": digest}
        gathered = [None] * self.world
        dist.all_gather_object(gathered, mine)
        if self.rank != 0:
            return None
        summary = self._summary(gathered, start)
        save_checkpoint(self.run_dir / FINAL, {"model": self.ddp.module.state_dict()},
                        self._manifest(self.config.steps))
        atomic_write_text(self.run_dir / SUMMARY, strict_json(summary, indent=1) + "\n")
        return summary

    def _summary(self, ranks: list[dict], start: int) -> dict[str, Any]:
        from qsync_lab.runtime.prediction import predict_plan

        accuracy, test_loss, chance = self._evaluate()
        profiles, costs = run_profiles(self.config.profiles, cuda=self.cuda), self.costs
        if self.model_profile:  # read first: its op rows win
            profiles = (self.model_profile, *profiles)
            costs = load_cost_model(*profiles)
        predicted = predict_plan(self.plan, self.graph, costs, optimizer=self.optimizer_name,
                                 on_cpu=not self.cuda)
        emulating = emulated_kinds(self.cluster if self.cuda else emulated_on_cpu(self.cluster))
        measured_ms = max(r["median_step_ms"] for r in ranks)
        predicted_ms = predicted.iteration_us / 1e3
        measured_mem = max(r["tensor_peak_bytes"] for r in ranks)
        predicted_mem = float(predicted.tensor_peak_bytes.max())
        return {
            "model": self.task.model_name or "user", "task": self.task.name,
            "cluster": self.cluster.name, "world_size": self.world,
            "backend": dist.get_backend(), "steps": self.config.steps, "resumed_from": start,
            "test_accuracy": accuracy, "test_loss": test_loss, "chance_accuracy": chance,
            "measured_step_ms": measured_ms, "predicted_step_ms": predicted_ms,
            "step_error_pct": 100 * (predicted_ms - measured_ms) / measured_ms,
            "measured_tensor_peak_mib": measured_mem / _MIB,
            "predicted_tensor_peak_mib": predicted_mem / _MIB,
            "tensor_peak_error_pct": 100 * (predicted_mem - measured_mem) / measured_mem,
            "optimizer": self.optimizer_name,
            "nonfinite_steps_skipped": self.nonfinite_skipped,
            "warmup_steps": self.warmup_used,
            "timed_steps": self.config.steps - start - self.warmup_used,
            "prediction_costs": ", ".join(Path(p).name for p in profiles) or "catalog roofline",
            "emulating": list(emulating),
            "plan_made_under": self.plan.made_under(),
            "ranks": ranks,
        }

    @torch.no_grad()
    def _evaluate(self) -> tuple[float | None, float, float | None]:
        """Test accuracy (None: the model returns more than class scores), test loss and
        chance accuracy (the most frequent test label's share: what always guessing it
        scores; None with no accuracy)."""
        model = self.ddp.module
        model.eval()
        inputs = map_inputs(self.task.test_inputs, lambda t: t.to(self.device))
        target = self.task.test_target.to(self.device)
        output = call_model(model, inputs)
        model.train()
        accuracy = chance = None  # a model returning more than class scores: the loss only
        if isinstance(output, torch.Tensor) and output.shape[:-1] == target.shape:
            accuracy = float((output.argmax(-1) == target).float().mean())
            chance = float(target.flatten().bincount().max()) / target.numel()
        return accuracy, float(self.loss_fn(output, target)), chance


def _process_peak_rss_bytes() -> int:
    """The process's peak resident set size (all memory, not only tensors), in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _progress(rank: int, start: int, steps: int):
    from tqdm.auto import tqdm

    return tqdm(total=steps, initial=start, desc="train", unit="step", disable=rank != 0,
                file=sys.stderr)


def _data_sha256(task: Task) -> str:
    """sha256 of a task's training and test tensors: a resume and every rank must train on
    the same data, whatever its name."""
    data = hashlib.sha256()
    for tensor in (*_tensors(task.train_inputs), task.train_target,
                   *_tensors(task.test_inputs), task.test_target):
        data.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return data.hexdigest()


def _listed(changes: dict[str, str]) -> str:
    """``{"seed": "0 -> 1"}`` as ``seed 0 -> 1``, comma-separated."""
    return ", ".join(f"{name} {change}" for name, change in changes.items())


def _described(err: Exception) -> str:
    """``KeyError: 'ranks'``: the error's type and the first line of its message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _tensors(inputs) -> list[torch.Tensor]:
    """A task's inputs (a tuple, or a dict passed as keywords) as a list of tensors."""
    return list(inputs.values()) if isinstance(inputs, dict) else list(inputs)


def _nonfinite_cause(losses: torch.Tensor, gradient: str) -> str:
    """What was non-finite: the loss (on which ranks), else the gradient of ``gradient``."""
    ranks = [str(r) for r, loss in enumerate(losses.tolist()) if not math.isfinite(loss)]
    return f"loss on rank {', '.join(ranks)}" if ranks else f"gradient of {gradient}"
