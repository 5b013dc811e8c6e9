"""Training tasks: a model of the zoo with its data, held in memory as tensors.

Bundled tasks (all generated or shipped locally, nothing is downloaded):

* ``digits`` — scikit-learn's 8x8 digits for ``digits_cnn`` (1347 train / 450 test images);
* ``mnist1d`` — MNIST-1D (40-sample 1-D signals of the 10 digits) generated locally by the
  ``mnist1d`` package for ``digits_mlp(in_features=40)`` (4000 / 1000);
* ``tokens`` — a synthetic sequence task for the BERT-style encoders: uniform token ids,
  label 1 when most tokens lie in the lower half of the vocabulary (learnable, balanced);
* ``synthetic`` — for any zoo model: seeded random inputs of the model's shape with fixed
  random labels (a memorisation task, for timing runs).

Your own model and data plug in as a :class:`Task` built by hand (see its docstring).

Example::

    >>> task = load_task("digits")
    >>> task.model_name, tuple(task.train_inputs[0].shape), len(task.test_target)
    ('digits_cnn', (1347, 1, 8, 8), 450)
"""

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from qsync_lab.batches import Inputs, call_model, map_inputs
from qsync_lab.errors import QSyncError
from qsync_lab.models import example_batch, get_model, model_spec
from qsync_lab.runtime.task_sizes import (SYNTHETIC_SAMPLES, TOKEN_SAMPLES, ZIPF_TOKEN_SAMPLES,
                                          default_task_name)

__all__ = ["TASKS", "Task", "call_model", "check_task", "default_task", "load_task",
           "map_inputs"]

MNIST1D_LENGTH = 40


@dataclass(frozen=True)
class Task:
    """A model and its data: what a training run needs besides the plan.

    A user task is built directly::

        >>> import torch
        >>> x, y = torch.randn(64, 5), torch.randint(2, (64,))
        >>> task = Task("xor-ish", model_name="", build_model=lambda: torch.nn.Linear(5, 2),
        ...             train_inputs=(x,), train_target=y, test_inputs=(x,), test_target=y)
        >>> task.num_train
        64

    Attributes:
        name: the task's name.
        model_name: the zoo model (empty for a user model).
        build_model: ``build_model() -> nn.Module`` with fresh weights (seeded by the caller).
        train_inputs / test_inputs: the model's positional inputs (a tuple), or a dict of
            them passed by name (``model(**batch)``); first dimension = samples.
        train_target / test_target: the targets, first dimension = samples.
        loss_fn: ``loss_fn() -> nn.Module`` computing a *mean* loss over the batch.
        model_kwargs: the zoo model's keyword arguments (recorded in checkpoints).
    """

    name: str
    model_name: str
    build_model: Callable[[], nn.Module]
    train_inputs: Inputs
    train_target: torch.Tensor
    test_inputs: Inputs
    test_target: torch.Tensor
    loss_fn: Callable[[], nn.Module] = nn.CrossEntropyLoss
    model_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            inputs, target = getattr(self, f"{split}_inputs"), getattr(self, f"{split}_target")
            tensors = inputs.values() if isinstance(inputs, Mapping) else inputs
            sizes = {len(t) for t in (*tensors, target)}
            if len(sizes) != 1 or not sizes.pop():
                raise QSyncError(f"task {self.name!r}: the {split} inputs and target must be "
                                 "non-empty and have the same number of samples")

    @property
    def num_train(self) -> int:
        return len(self.train_target)

    def example(self, batch_size: int):
        """The first ``batch_size`` training samples (for tracing the model): inputs (as the
        task holds them, a tuple or a dict) and target."""
        return (map_inputs(self.train_inputs, lambda t: t[:batch_size]),
                self.train_target[:batch_size])


def default_task(model: str) -> str:
    """The bundled task a zoo model trains on by default.

    Example::

        >>> default_task("digits_mlp"), default_task("resnet18")
        ('mnist1d', 'synthetic')
    """
    return default_task_name(model_spec(model).name)


def load_task(name: str, model: str | None = None, *, seed: int = 0, **model_kwargs: Any) -> Task:
    """Build the bundled task ``name`` (see the module docstring).

    Args:
        name: ``digits``, ``mnist1d``, ``tokens`` or ``synthetic``.
        model: the zoo model to train (default: the task's own model; ``synthetic`` needs one).
        seed: seed of the data (split, generation).
        model_kwargs: the model's keyword arguments (``tokens`` and ``synthetic`` shape their
            data from them).

    Raises:
        QSyncError: an unknown task, or a model the task's data does not fit.
    """
    model = check_task(name, model)
    return TASKS[name][1](model, seed, dict(model_kwargs))


def check_task(name: str, model: str | None = None) -> str:
    """The zoo model that task ``name`` trains (``model``, or the task's own), once it is
    sure the task exists and fits it.

    Raises:
        QSyncError: an unknown task, or a model the task's data does not fit; one line.
    """
    if name not in TASKS:
        raise QSyncError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    own_model = TASKS[name][0]
    model = model_spec(model or own_model or _needs_model(name)).name
    if own_model is not None and not _fits(own_model, model):
        raise QSyncError(f"task {name!r} trains {own_model}, not {model}; use --data "
                         f"{default_task(model)} for {model}")
    return model


def _needs_model(name: str) -> str:
    raise QSyncError(f"task {name!r} needs a model; pass model=... (--model)")


def _fits(own_model: str, model: str) -> bool:
    return own_model == model or (own_model == "bert_mini" and model.startswith("bert_"))


def _task(name, model, kwargs, train, test) -> Task:
    return Task(name, model, lambda: get_model(model, **kwargs), train[0], train[1], test[0],
                test[1], model_spec(model).loss_fn, kwargs)


def _digits(model: str, seed: int, kwargs: dict) -> Task:
    from qsync_lab.datasets import load_digits_split

    x_train, y_train, x_test, y_test = load_digits_split(seed=seed)
    return _task("digits", model, kwargs, ((x_train,), y_train), ((x_test,), y_test))


def _mnist1d(model: str, seed: int, kwargs: dict) -> Task:
    from mnist1d.data import get_dataset_args, make_dataset

    if kwargs.get("in_features", MNIST1D_LENGTH) != MNIST1D_LENGTH:
        raise QSyncError(f"the mnist1d task's signals have {MNIST1D_LENGTH} samples; build "
                         f"digits_mlp with in_features={MNIST1D_LENGTH}, not "
                         f"{kwargs['in_features']!r}")
    kwargs = {**kwargs, "in_features": MNIST1D_LENGTH}
    args = get_dataset_args()
    args.seed = seed
    states = random.getstate(), np.random.get_state()
    try:  # make_dataset seeds the global generators: leave them as they were
        data = make_dataset(args)
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])

    def split(x, y):
        return (torch.from_numpy(x).float(),), torch.from_numpy(y).long()

    return _task("mnist1d", model, kwargs, split(data["x"], data["y"]),
                 split(data["x_test"], data["y_test"]))


def _binary_token_task(name: str, model: str, seed: int,
                       kwargs: dict) -> tuple[torch.Generator, int, int]:
    """A two-label token task's generator, vocabulary size and sequence length."""
    defaults = model_spec(model).defaults
    if kwargs.get("num_labels", defaults["num_labels"]) != 2:
        raise QSyncError(f"the {name} task has 2 labels; use num_labels=2")
    return (torch.Generator().manual_seed(seed), kwargs.get("vocab_size", defaults["vocab_size"]),
            kwargs.get("seq_len", defaults["seq_len"]))


def _tokens(model: str, seed: int, kwargs: dict) -> Task:
    generator, vocab, seq_len = _binary_token_task("tokens", model, seed, kwargs)

    def split(samples):
        ids = torch.randint(vocab, (samples, seq_len), generator=generator)
        return (ids,), ((ids < vocab // 2).sum(1) * 2 > seq_len).long()

    return _task("tokens", model, kwargs, *map(split, TOKEN_SAMPLES))


def _synthetic(model: str, seed: int, kwargs: dict) -> Task:
    train, test = (example_batch(model, n, seed=seed + i, **kwargs)
                   for i, n in enumerate(SYNTHETIC_SAMPLES))
    return _task("synthetic", model, kwargs, train, test)


def _zipf_tokens(model: str, seed: int, kwargs: dict) -> Task:
    """Majority vote between two token classes whose tokens follow Zipf's law.

    The vocabulary (id 0 left out) splits into class A (the lower half of the ids) and
    class B (as many ids above them), with the same Zipf profile: the k-th id of a class is
    drawn with probability proportional to 1 / k. Each position picks its class with even
    odds, then an id. Label 1 when class A holds more than half of the positions. Unlike
    ``tokens``, the ids' frequencies are skewed as in text (with 64 ids per class the
    rarest is drawn 64 times less often than the most frequent), so the class of rare ids
    must be learned from few examples; margins are often one token (use an odd ``seq_len``
    for no ties).

    Example::

        >>> task = load_task("zipf_tokens", "bert_mini", vocab_size=9, seq_len=5)
        >>> ids, label = task.train_inputs[0][0], task.train_target[0]
        >>> bool(label) == bool(((ids <= 4).sum() > 2))
        True
    """
    generator, vocab, seq_len = _binary_token_task("zipf_tokens", model, seed, kwargs)
    per_class = (vocab - 1) // 2
    if per_class < 2:
        raise QSyncError(f"the zipf_tokens task needs vocab_size >= 5, got {vocab}")
    zipf = 1.0 / torch.arange(1, per_class + 1, dtype=torch.float64)

    def split(samples):
        rank = torch.multinomial(zipf, samples * seq_len, replacement=True,
                                 generator=generator).view(samples, seq_len)
        in_a = torch.rand(samples, seq_len, generator=generator) < 0.5
        ids = 1 + rank + per_class * (~in_a).long()
        return (ids,), (in_a.sum(1) * 2 > seq_len).long()

    return _task("zipf_tokens", model, kwargs, *map(split, ZIPF_TOKEN_SAMPLES))


#: task name -> (its model, or None for any zoo model; loader(model, seed, model_kwargs))
TASKS: dict[str, tuple[str | None, Callable[[str, int, dict], Task]]] = {
    "digits": ("digits_cnn", _digits),
    "mnist1d": ("digits_mlp", _mnist1d),
    "tokens": ("bert_mini", _tokens),
    "synthetic": (None, _synthetic),
    "zipf_tokens": ("bert_mini", _zipf_tokens),
}

