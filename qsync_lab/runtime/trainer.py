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
4. rank 0 appends one line per step to ``metrics.jsonl`` (every rank's step time and
   process peak RSS so far, the global loss and throughput) and writes a checkpoint every
   ``checkpoint_every`` steps (:mod:`~qsync_lab.runtime.checkpoint`); with ``resume`` a
   run continues from the run folder's checkpoint, exactly (same data, RNG states and
   rounding streams), which is what a torchrun restart does after a worker dies;
5. at the end rank 0 evaluates test accuracy and writes ``summary.json``: measured median
   step time (after ``warmup_steps``, clipped so that at least one step is timed; the
   summary says how many were left out) and peak tensor memory beside the simulator's
   prediction for the same plan and optimizer (emulated kinds costed from the locally
   measured profile), and ``final.pt``.

The rank's process keeps the host memory it frees (:mod:`qsync_lab.hostmem`), as the
profiler's processes do: steady steps take no page faults, in the run and in the profile.

Peak tensor memory for the summary: on CUDA ``max_memory_allocated``; on the CPU,
torch.profiler memory events with c10's all-thread accounting over the model build and the
first ``MEMORY_STEPS`` steps of each attempt (the live tensor bytes' maximum;
:mod:`qsync_lab.runtime.memory`).
"""

import hashlib
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

from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph
from qsync_lab.hostmem import keep_freed_memory
from qsync_lab.io import atomic_write_text
from qsync_lab.optimizers import OPTIMIZER_STATES
from qsync_lab.plan import Plan
from qsync_lab.quant import apply_resolved_plan_, restore_rounding_counters, rounding_counters
from qsync_lab.runtime.checkpoint import (capture_rng_state, load_checkpoint, restore_rng_state,
                                          save_checkpoint)
from qsync_lab.runtime.memory import MemoryWindow
from qsync_lab.runtime.metrics import MetricsLog
from qsync_lab.runtime.options import TrainConfig
from qsync_lab.runtime.sampler import UnevenBatchSampler, loss_weight
from qsync_lab.runtime.tasks import Task, call_model, default_task, load_task, map_inputs

__all__ = ["DEVICE_KIND_ENV", "TrainConfig", "train"]

DEVICE_KIND_ENV = "QSYNC_DEVICE_KIND"
MEMORY_STEPS = 2
MIN_WARMUP_STEPS = 3
CHECKPOINT = "checkpoint.pt"
_MIB = 2**20


def train(config: TrainConfig, task: Task | None = None) -> dict[str, Any] | None:
    """Run ``config`` on this rank (see the module docstring); rank 0 returns the summary.

    ``task`` plugs in a user model and data (:class:`~qsync_lab.runtime.tasks.Task`);
    by default the plan's zoo model trains on its bundled task. The process group is
    created here (torchrun's environment) unless one exists.
    """
    keep_freed_memory()
    own_group = not dist.is_initialized()
    if own_group:
        _init_process_group()
    try:
        return _Run(config, task).train()
    finally:
        if own_group:
            dist.destroy_process_group()


def _init_process_group() -> None:
    """The default group from torchrun's environment, its store keys prefixed by the restart
    count: after a restart, torchrun's store still holds the dead attempt's addresses under
    the default keys, and connecting to them fails ("Connection refused")."""
    store, rank, world = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            store=dist.PrefixStore(f"qsync_lab/attempt{attempt}", store),
                            rank=rank, world_size=world)


class _Run:
    """One rank's training run (state shared by the steps of :func:`train`)."""

    def __init__(self, config: TrainConfig, task: Task | None) -> None:
        self.config = config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.run_dir = Path(config.run_dir)
        self.cuda = torch.cuda.is_available()
        self.device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                       if self.cuda else torch.device("cpu"))
        if self.cuda:
            torch.cuda.set_device(self.device)
        if config.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.plan = Plan.load(config.plan)
        self.cluster = self.plan.cluster
        if self.plan.world_size != self.world:
            raise QSyncError(f"the plan's cluster {self.cluster.name!r} has "
                             f"{self.plan.world_size} ranks but torchrun started {self.world}; "
                             f"use --nproc-per-node={self.plan.world_size} (or re-plan)")
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

    def _zoo_task(self) -> Task:
        model = self.config.model or self.plan.model_name
        if not model:
            raise QSyncError("the plan names no model; pass --model (a zoo model)")
        kwargs = (self.config.model_kwargs if self.config.model_kwargs is not None
                  else dict(self.plan.model_kwargs))
        return load_task(self.config.data or default_task(model), model,
                         seed=self.config.seed, **kwargs)

    def _profile_model(self) -> str | None:
        """The profile of a user model's ops, timed before it trains for the prediction
        (cached; :mod:`qsync_lab.profile.model_cache`); None when profiles were given or the
        ranks run on CUDA (whose in-step times the host clock cannot read)."""
        if self.task.model_name or self.config.profiles or self.cuda:
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
                batch_sizes=self.batch_sizes, precisions=sorted(precisions)))
        except QSyncError as err:
            if self.rank == 0:
                print(f"qsync_lab: {err}", file=sys.stderr)
            return None

    def _build(self):
        torch.manual_seed(self.config.seed)
        model = self.task.build_model()
        inputs, target = self.task.example(self.batch_sizes[self.rank])
        graph = trace_graph(model, inputs, target=target, loss_fn=self.task.loss_fn())
        self.plan.validate(graph, self.cluster)
        device_spec = self.cluster.catalog.device(self.kind)
        self.applied = apply_resolved_plan_(model, graph, self.plan.precisions[self.kind],
                                             device_spec)
        self.graph = graph
        model = model.to(self.device)
        self.ddp = DistributedDataParallel(model, device_ids=[self.device] if self.cuda else None)
        self.compression = None
        if self.plan.compression_settings:
            from qsync_lab.compress import register_compression

            self.compression = register_compression(self.ddp, self.plan.compression_settings,
                                                    seed=self.config.seed)
        self.optimizer = make_optimizer(self.optimizer_name, self.ddp.parameters(),
                                        lr=self.config.lr, momentum=self.config.momentum)

    def _restore(self) -> int:
        path = self.run_dir / CHECKPOINT
        if not (self.config.resume and path.exists()):
            return 0
        state = load_checkpoint(path)
        if state["plan"] != self.plan.to_dict():
            raise QSyncError(f"{path} was written under another plan; resume with the same "
                             "--plan or start a fresh --run-dir")
        if len(state["rng"]) != self.world:
            raise QSyncError(f"{path} has {len(state['rng'])} ranks, this run {self.world}")
        self.ddp.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        restore_rounding_counters(self.ddp.module, state["rounding"][self.rank])
        if self.compression is not None:
            self.compression.load_state_dict(state["compression"][self.rank])
        restore_rng_state(state["rng"][self.rank])
        return int(state["step"])

    def _checkpoint(self, step: int) -> None:
        mine = (capture_rng_state(), rounding_counters(self.ddp.module),
                self.compression.state_dict() if self.compression is not None else None)
        gathered = [None] * self.world
        dist.all_gather_object(gathered, mine)
        if self.rank == 0:
            save_checkpoint(self.run_dir / CHECKPOINT, {
                "step": step, "model": self.ddp.module.state_dict(),
                "optimizer": self.optimizer.state_dict(), "plan": self.plan.to_dict(),
                "rng": [g[0] for g in gathered], "rounding": [g[1] for g in gathered],
                "compression": [g[2] for g in gathered],
                "config": {k: v for k, v in vars(self.config).items()}})

    def _step(self, step: int) -> tuple[float, float]:
        """One global step; returns (this rank's step time in ms, its mean loss)."""
        index = self.sampler.indices(step, self.rank)
        inputs = map_inputs(self.task.train_inputs, lambda t: t[index].to(self.device))
        target = self.task.train_target[index].to(self.device)
        begin = time.perf_counter()
        self.optimizer.zero_grad()
        loss = self.loss_fn(call_model(self.ddp, inputs), target)
        (loss * self.weight).backward()
        self.optimizer.step()
        if self.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - begin) * 1e3, float(loss.detach())

    def train(self) -> dict[str, Any] | None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            for stale in self.run_dir.glob(f".{CHECKPOINT}.*.tmp"):  # a writer killed mid-write
                stale.unlink(missing_ok=True)
        self._write_rank_file()
        self.model_profile = self._profile_model()
        memory = MemoryWindow(self.cuda)  # model build + the first MEMORY_STEPS steps
        step_times: list[float] = []
        log = None
        try:
            self._build()
            start = self._restore()
            if self.rank == 0:
                log = MetricsLog(self.run_dir / "metrics.jsonl", resume_step=start)
            with _progress(self.rank, start, self.config.steps) as progress:
                for step in range(start, self.config.steps):
                    step_ms, loss = self._step(step)
                    if step + 1 - start == MEMORY_STEPS:
                        memory.close()
                    step_times.append(step_ms)
                    self._log(log, step, step_ms, loss)
                    progress.update(1)
                    if self.config.checkpoint_every and \
                            (step + 1) % self.config.checkpoint_every == 0:
                        self._checkpoint(step + 1)
        finally:
            memory.close()
            if log is not None:
                log.close()
        return self._finish(step_times, memory.peak_bytes, start)

    def _log(self, log: MetricsLog | None, step: int, step_ms: float, loss: float) -> None:
        mine = torch.tensor([step_ms, loss, float(_process_peak_rss_bytes())],
                            dtype=torch.float64, device=self.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)  # on the rank's device: NCCL gathers CUDA tensors
        telemetry = self.compression.telemetry() if self.compression is not None else None
        if log is None:
            return
        ranks = torch.stack(gathered).cpu()
        slowest_ms = float(ranks[:, 0].max())
        global_loss = float(sum(b * ranks[r, 1] for r, b in enumerate(self.batch_sizes))
                            / sum(self.batch_sizes))
        record = {"step": step, "loss": global_loss,
                  "step_ms": [round(float(t), 4) for t in ranks[:, 0]],
                  "throughput_samples_per_s": sum(self.batch_sizes) / (slowest_ms / 1e3),
                  "process_peak_rss_mib": [round(float(m) / _MIB, 1) for m in ranks[:, 2]],
                  "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
        if telemetry is not None:  # rank 0's: its own gradients' compression
            record["compression"] = telemetry
        log.write(record)

    def _write_rank_file(self) -> None:
        atomic_write_text(self.run_dir / "ranks" / f"rank{self.rank}.json",
                          f'{{"pid": {os.getpid()}, "kind": "{self.kind}", "attempt": '
                          f'{os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}}}\n')

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
        save_checkpoint(self.run_dir / "final.pt", {"step": self.config.steps,
                                                    "model": self.ddp.module.state_dict()})
        atomic_write_text(self.run_dir / "summary.json", _json(summary))
        return summary

    def _summary(self, ranks: list[dict], start: int) -> dict[str, Any]:
        from qsync_lab.costs import load_cost_model
        from qsync_lab.resources import data_file
        from qsync_lab.runtime.prediction import predict_plan

        accuracy, test_loss = self._evaluate()
        profiles = self.config.profiles or ((str(data_file("profiles", "cpu.csv")),)
                                            if not self.cuda else ())
        if self.model_profile:  # read first: its op rows win
            profiles = (self.model_profile, *profiles)
        predicted = predict_plan(self.plan, self.graph, load_cost_model(*profiles),
                                 optimizer=self.optimizer_name)
        measured_ms = max(r["median_step_ms"] for r in ranks)
        predicted_ms = predicted.iteration_us / 1e3
        measured_mem = max(r["tensor_peak_bytes"] for r in ranks)
        predicted_mem = float(predicted.tensor_peak_bytes.max())
        return {
            "model": self.task.model_name or "user", "task": self.task.name,
            "cluster": self.cluster.name, "world_size": self.world,
            "backend": dist.get_backend(), "steps": self.config.steps, "resumed_from": start,
            "test_accuracy": accuracy, "test_loss": test_loss,
            "measured_step_ms": measured_ms, "predicted_step_ms": predicted_ms,
            "step_error_pct": 100 * (predicted_ms - measured_ms) / measured_ms,
            "measured_tensor_peak_mib": measured_mem / _MIB,
            "predicted_tensor_peak_mib": predicted_mem / _MIB,
            "tensor_peak_error_pct": 100 * (predicted_mem - measured_mem) / measured_mem,
            "optimizer": self.optimizer_name,
            "warmup_steps": self.warmup_used,
            "timed_steps": self.config.steps - start - self.warmup_used,
            "prediction_costs": ", ".join(Path(p).name for p in profiles) or "catalog roofline",
            "ranks": ranks,
        }

    @torch.no_grad()
    def _evaluate(self) -> tuple[float, float]:
        model = self.ddp.module
        model.eval()
        inputs = map_inputs(self.task.test_inputs, lambda t: t.to(self.device))
        target = self.task.test_target.to(self.device)
        output = call_model(model, inputs)
        model.train()
        accuracy = None  # a model returning more than class scores: the loss only
        if isinstance(output, torch.Tensor) and output.shape[:-1] == target.shape:
            accuracy = float((output.argmax(-1) == target).float().mean())
        return accuracy, float(self.loss_fn(output, target))


def _process_peak_rss_bytes() -> int:
    """The process's peak resident set size (all memory, not only tensors), in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def make_optimizer(name: str, parameters, *, lr: float, momentum: float = 0.9):
    """The torch optimizer called ``name`` (one of :data:`~qsync_lab.optimizers.OPTIMIZER_STATES`).

    Example::

        >>> import torch
        >>> make_optimizer("sgd", [torch.nn.Parameter(torch.zeros(2))], lr=0.1).defaults["momentum"]
        0
    """
    parameters = list(parameters)
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr)
    if name == "sgd_momentum":
        return torch.optim.SGD(parameters, lr=lr, momentum=momentum)
    if name == "adam":
        return torch.optim.Adam(parameters, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=lr)
    raise QSyncError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZER_STATES)}")


def _progress(rank: int, start: int, steps: int):
    from tqdm.auto import tqdm

    return tqdm(total=steps, initial=start, desc="train", unit="step", disable=rank != 0,
                file=sys.stderr)


def _json(document: Any) -> str:
    import json

    return json.dumps(document, indent=1) + "\n"
