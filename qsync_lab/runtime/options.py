"""The options of a training run: :class:`TrainConfig` and the runtime's command line.

``python -m qsync_lab.runtime`` and ``qsync-lab run`` read the same options
(:func:`runtime_parser`), so ``qsync-lab run`` checks them before it starts any process and
hands them on as :func:`runtime_argv` writes them.

Example::

    >>> config = config_from_args(runtime_parser().parse_args(["--plan", "p.json", "--steps", "5"]))
    >>> config.steps, runtime_argv(config)[:4]
    (5, ['--plan', 'p.json', '--run-dir', 'qsync_run'])
    >>> runtime_parser().parse_args(["--plan", "p.json", "--steps", "x"])
    Traceback (most recent call last):
    ...
    qsync_lab.errors.QSyncError: argument --steps: invalid int value: 'x'
"""

import argparse
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from qsync_lab.errors import QSyncError
from qsync_lab.limits import loads_json
from qsync_lab.optimizers import OPTIMIZER_STATES

__all__ = ["NONFINITE_POLICIES", "SAFE_CHANGES", "TrainConfig", "config_from_args",
           "option_name", "runtime_argv", "runtime_parser"]

#: what a step with a non-finite loss or gradient does: stop the run, or skip the update
NONFINITE_POLICIES = ("stop", "skip")
#: the settings a resume may change, each only when named in ``allow_change``
#: (``--allow-change``); any other change makes another run
SAFE_CHANGES = ("steps", "checkpoint_every", "keep_checkpoints", "on_nonfinite",
                "deterministic", "warmup_steps")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs besides the plan file's contents.

    Attributes:
        plan: path of the plan JSON (``qsync-lab plan`` or ``Plan.save``).
        run_dir: where metrics, checkpoints, the summary and the final weights go.
        model: zoo model (default: the one the plan records).
        model_kwargs: its keyword arguments (default: the plan's).
        data: bundled task (default: the model's, :func:`~qsync_lab.runtime.tasks.default_task`).
        steps: global training steps.
        optimizer: ``sgd``, ``sgd_momentum`` (with ``momentum``), ``adam`` or ``adamw``
            (transformers train far better with it); None: the plan's, which its memory
            prediction counts.
        lr, momentum: the learning rate; ``sgd_momentum``'s momentum.
        seed: model initialisation, data order and split.
        checkpoint_every: steps between checkpoints (0: none).
        keep_checkpoints: how many of the newest checkpoints are kept.
        resume: continue from ``run_dir``'s newest valid checkpoint if there is one (the
            run's settings must be the checkpoint's, but for those in ``allow_change``).
        allow_change: settings of :data:`SAFE_CHANGES` that a resume may change (e.g.
            ``("steps",)`` to train further).
        on_nonfinite: ``"stop"``: a non-finite loss or gradient stops the run; ``"skip"``:
            its step is skipped on every rank (counted in the summary).
        deterministic: ``torch.use_deterministic_algorithms(True)`` (bit-reproducible runs).
        warmup_steps: steps of each attempt left out of the step-time median (None: the
            first fifth, at least 3; a ms-scale model's gloo and allocator warm up over
            tens of steps).
        profiles: measured profile CSVs for the prediction (default: the shipped CPU one).
        emulate: run every rank on the CPU, emulating its device kind (GPU kinds too, which
            ``qsync-lab run`` otherwise refuses without CUDA), predicted with this machine's
            costs.
    """

    plan: str
    run_dir: str = "qsync_run"
    model: str | None = None
    model_kwargs: dict[str, Any] | None = None
    data: str | None = None
    steps: int = 100
    optimizer: str | None = None
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    checkpoint_every: int = 20
    keep_checkpoints: int = 2
    resume: bool = False
    allow_change: tuple[str, ...] = ()
    on_nonfinite: str = "stop"
    deterministic: bool = False
    warmup_steps: int | None = None
    profiles: tuple[str, ...] = field(default_factory=tuple)
    emulate: bool = False

    def __post_init__(self) -> None:
        if self.optimizer is not None and self.optimizer not in OPTIMIZER_STATES:
            raise QSyncError(f"unknown optimizer {self.optimizer!r}; choose one of: "
                             f"{', '.join(OPTIMIZER_STATES)}")
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise QSyncError(f"--on-nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, "
                             f"got {self.on_nonfinite!r}")
        for name, least in (("steps", 1), ("checkpoint_every", 0), ("keep_checkpoints", 1),
                            ("warmup_steps", 0)):
            value = getattr(self, name)
            if value is None and name == "warmup_steps":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                what = "a positive" if least else "a non-negative"
                raise QSyncError(f"--{option_name(name)} must be {what} integer, got "
                                 f"{value!r}")
        for name in ("lr", "momentum"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise QSyncError(f"--{name} must be a finite non-negative number, got {value!r}")
        if self.momentum >= 1:
            raise QSyncError(f"--momentum must be below 1 (0.9 is usual), got {self.momentum!r}: "
                             "at 1 or more the updates grow without bound")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not 0 <= self.seed < 2**32:
            raise QSyncError(f"--seed must be an integer from 0 to 2**32 - 1, got {self.seed!r}")
        if self.model_kwargs is not None and not isinstance(self.model_kwargs, dict):
            raise QSyncError(f"model_kwargs must be a dict, got {self.model_kwargs!r}")
        unknown = [name for name in self.allow_change if name not in SAFE_CHANGES]
        if unknown:
            raise QSyncError(f"--allow-change takes {', '.join(map(option_name, SAFE_CHANGES))}"
                             f"; a change of {option_name(unknown[0])!r} makes another run: "
                             "start a fresh --run-dir")
        if self.allow_change and not self.resume:
            raise QSyncError("--allow-change applies with --resume (what a resumed run may "
                             "change); add --resume, or drop --allow-change for a fresh run")


def option_name(setting: str) -> str:
    """A setting as its option is spelled: ``checkpoint_every`` -> ``checkpoint-every``."""
    return setting.replace("_", "-")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one-line :class:`QSyncError`\\ s."""

    def error(self, message: str):
        raise QSyncError(message)


def runtime_parser(*, add_help: bool = True) -> argparse.ArgumentParser:
    """The runtime's options (``python -m qsync_lab.runtime --help``)."""
    parser = _Parser(prog="python -m qsync_lab.runtime", add_help=add_help,
                     description="Train a qsync_lab plan on this rank (start it with torchrun "
                     "or `qsync-lab run`).")
    parser.add_argument("--plan", required=True, help="plan JSON (qsync-lab plan --out)")
    parser.add_argument("--run-dir", default="qsync_run",
                        help="metrics, checkpoints and summary go here (default qsync_run)")
    parser.add_argument("--model", help="zoo model (default: the plan's)")
    parser.add_argument("--model-kwargs", help="JSON dict of the model's keyword arguments")
    parser.add_argument("--data", help="bundled task: digits, mnist1d, tokens, zipf_tokens, "
                        "synthetic (default: the model's; each trains its own kind of model)")
    parser.add_argument("--steps", type=int, default=100, help="training steps (100)")
    parser.add_argument("--optimizer", choices=list(OPTIMIZER_STATES),
                        help="default: the plan's (its memory prediction counts it)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (0.05)")
    parser.add_argument("--momentum", type=float, default=0.9, help="sgd_momentum's (0.9)")
    parser.add_argument("--seed", type=int, default=0,
                        help="model initialisation, data split and order (0)")
    parser.add_argument("--checkpoint-every", type=int, default=20,
                        help="steps between checkpoints (20; 0: none)")
    parser.add_argument("--keep-checkpoints", type=int, default=2,
                        help="how many of the newest checkpoints to keep (2)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from --run-dir's newest valid checkpoint when there is "
                        "one (same settings, but for those --allow-change names)")
    parser.add_argument("--allow-change", default="", metavar="NAMES",
                        help="with --resume: settings that may differ from the checkpoint's, "
                        f"comma-separated, of: {', '.join(map(option_name, SAFE_CHANGES))} "
                        "(e.g. steps, to train further)")
    parser.add_argument("--on-nonfinite", choices=list(NONFINITE_POLICIES), default="stop",
                        help="a non-finite loss or gradient stops the run (default) or its "
                        "step is skipped on every rank")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True)")
    parser.add_argument("--warmup-steps", type=int,
                        help="steps left out of the step-time median (default: the first "
                        "fifth, at least 3)")
    parser.add_argument("--profile", action="append", default=[], metavar="CSV",
                        help="measured profile(s) for the prediction (default: shipped cpu.csv)")
    parser.add_argument("--emulate", action="store_true",
                        help="run every rank on the CPU emulating its device kind (a V100 + "
                        "T4 plan on a laptop), predicted with this machine's costs")
    parser.add_argument("--threads", type=int,
                        help="intra-op threads per rank (default: cores / local ranks)")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed runtime options (checked)."""
    kwargs = loads_json(args.model_kwargs, "--model-kwargs") if args.model_kwargs else None
    if args.threads is not None and args.threads < 1:
        raise QSyncError(f"--threads must be a positive integer, got {args.threads}")
    return TrainConfig(
        plan=args.plan, run_dir=args.run_dir, model=args.model, model_kwargs=kwargs,
        data=args.data, steps=args.steps, optimizer=args.optimizer, lr=args.lr,
        momentum=args.momentum, seed=args.seed, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, resume=args.resume,
        allow_change=tuple(name.strip().replace("-", "_")
                           for name in args.allow_change.split(",") if name.strip()),
        on_nonfinite=args.on_nonfinite, deterministic=args.deterministic,
        warmup_steps=args.warmup_steps, profiles=tuple(args.profile), emulate=args.emulate)


def runtime_argv(config: TrainConfig, *, threads: int | None = None) -> list[str]:
    """``config`` as ``python -m qsync_lab.runtime`` options (defaults left out)."""
    argv = ["--plan", str(config.plan), "--run-dir", str(config.run_dir)]
    defaults = TrainConfig(plan="")
    for f in fields(TrainConfig):
        value = getattr(config, f.name)
        if f.name in ("plan", "run_dir") or value == getattr(defaults, f.name):
            continue
        flag = "--" + option_name(f.name)
        if isinstance(value, bool):
            argv.append(flag)
        elif f.name == "profiles":
            argv += [arg for path in value for arg in ("--profile", str(path))]
        elif f.name == "allow_change":
            argv += [flag, ",".join(map(option_name, value))]
        elif f.name == "model_kwargs":
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    if threads is not None:
        argv += ["--threads", str(threads)]
    return argv
