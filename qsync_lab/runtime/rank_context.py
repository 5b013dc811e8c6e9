"""What one rank of a run is before its model exists: its device, device kind, task and
slice of the data, and the settings that make the run this run.

:class:`RankContext` reads the plan and the options on every rank, inside the process
group, and refuses at once what would otherwise fail later: a world size that is not the
plan's, a device kind not in the plan (``QSYNC_DEVICE_KIND`` overrides the plan's), a bad
``--profile``, ``--on-nonfinite skip`` beside gradient compression. A CUDA rank enters its
GPU, and its share of the GPU's SMs, before any other CUDA work.

Its ``settings`` are what a checkpoint records and a resume compares
(:mod:`qsync_lab.runtime.run_state`); :meth:`RankContext.identity` is what every rank
must share (:func:`~qsync_lab.runtime.agreement.check_ranks_agree`).
"""

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qsync_lab.costs import load_cost_model
from qsync_lab.errors import QSyncError
from qsync_lab.graph import OpGraph
from qsync_lab.plan import Plan
from qsync_lab.runtime.gpu_share import enter_sm_partition
from qsync_lab.runtime.options import SAFE_CHANGES, TrainConfig
from qsync_lab.runtime.prediction import run_profiles
from qsync_lab.runtime.sampler import UnevenBatchSampler, loss_weight
from qsync_lab.runtime.tasks import Task, default_task, load_task

__all__ = ["DEVICE_KIND_ENV", "RankContext", "run_settings", "zoo_task"]

DEVICE_KIND_ENV = "QSYNC_DEVICE_KIND"
#: options every rank must share besides the run's settings (a rank that resumes alone, or
#: refuses a resume the others allow, would leave the others waiting in a collective)
_SHARED_OPTIONS = ("resume", "allow_change")


class RankContext:
    """One rank's view of a run (see the module docstring); built in the process group."""

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
        self.task = task if task is not None else zoo_task(config, self.plan)
        self.batch_sizes = self.plan.batch_sizes
        self.sampler = UnevenBatchSampler(self.task.num_train, self.batch_sizes, config.seed)
        self.weight = loss_weight(self.batch_sizes, self.rank)
        self.loss_fn = self.task.loss_fn()
        if config.on_nonfinite == "skip" and self.plan.compression_settings:
            raise QSyncError("--on-nonfinite skip does not work with gradient compression (its "
                             "hooks stop every rank at a non-finite gradient); use "
                             "--on-nonfinite stop or a plan without compression")
        self.settings = run_settings(config, self.plan, self.task)

    def identity(self, graph: OpGraph) -> dict[str, str]:
        """What every rank must share, one field each, so that a difference is named
        (:func:`~qsync_lab.runtime.agreement.check_ranks_agree`): the plan, the model built
        (its ``graph``), the cluster, every setting (the data's sha256 among them) and the
        options."""
        fields = {"plan": self.settings["plan"], "model_graph": graph.fingerprint(),
                  "cluster": self.cluster.fingerprint(), **self.settings,
                  **{name: getattr(self.config, name) for name in _SHARED_OPTIONS}}
        return {name: json.dumps(value, sort_keys=True) for name, value in fields.items()}

    def note(self, line: str) -> None:
        """One line on rank 0's stderr, marked ``qsync_lab:`` (``qsync-lab run`` shows
        such lines from the ranks' log)."""
        if self.rank == 0:
            print(f"qsync_lab: {line}", file=sys.stderr)


def zoo_task(config: TrainConfig, plan: Plan) -> Task:
    """The bundled task a run of ``plan`` trains: its zoo model (``--model`` or the plan's,
    with ``--model-kwargs`` or the plan's) on ``--data`` or the model's own task."""
    model = config.model or plan.model_name
    if not model:
        raise QSyncError("the plan names no model; pass --model (a zoo model)")
    kwargs = config.model_kwargs if config.model_kwargs is not None else dict(plan.model_kwargs)
    return load_task(config.data or default_task(model), model, seed=config.seed, **kwargs)


def run_settings(config: TrainConfig, plan: Plan, task: Task) -> dict[str, Any]:
    """What makes a run this run (a checkpoint records it, a resume compares it), then the
    options a resume may change only when ``allow_change`` names them
    (:data:`~qsync_lab.runtime.options.SAFE_CHANGES`). The same on every rank, and in the
    launcher, which checks a resume before any rank starts."""
    plan_dict = plan.to_dict()
    defining = {
        "seed": config.seed, "lr": config.lr, "momentum": config.momentum,
        "optimizer": config.optimizer or plan.optimizer, "batch_sizes": list(plan.batch_sizes),
        "world_size": plan.world_size, "model": task.model_name,
        "model_kwargs": task.model_kwargs, "data": task.name, "data_sha256": _data_sha256(task),
        "compression": plan_dict["_data"]["compression"],
        "plan": hashlib.sha256(json.dumps(plan_dict, sort_keys=True).encode()).hexdigest()}
    return {**defining, **{name: getattr(config, name) for name in SAFE_CHANGES}}


def _data_sha256(task: Task) -> str:
    """sha256 of a task's training and test tensors: a resume and every rank must train on
    the same data, whatever its name."""
    data = hashlib.sha256()
    for tensor in (*_tensors(task.train_inputs), task.train_target,
                   *_tensors(task.test_inputs), task.test_target):
        data.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return data.hexdigest()


def _tensors(inputs) -> list[torch.Tensor]:
    """A task's inputs (a tuple, or a dict passed as keywords) as a list of tensors."""
    return list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
