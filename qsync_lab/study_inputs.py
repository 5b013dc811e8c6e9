"""The arguments of a :class:`~qsync_lab.study.Study`, checked and made into the pipeline's
inputs: its model, cluster, precisions, constraints and strategy.

Example::

    >>> from qsync_lab.study_inputs import (as_cluster, cluster_low_precisions,
    ...                                     constraints_from, study_model)
    >>> model = study_model("digits_mlp")
    >>> model.name, model.zoo_name, len(model.batch(seed=1)[1])
    ('digits_mlp', 'digits_mlp', 2)
    >>> cluster = as_cluster("local-hybrid")
    >>> [str(p) for p in cluster_low_precisions(cluster)]
    ['fp16', 'int8']
    >>> dict(constraints_from(8, None, cluster.device_kinds).memory_gib)
    {'V100-SXM2-32GB': 8.0, 'T4': 8.0}
"""

import functools
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from qsync_lab.cluster import Cluster, load_cluster
from qsync_lab.constraints import Constraints
from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision

__all__ = ["StudyModel", "allocation_strategy", "as_cluster", "calibration_count",
           "cluster_low_precisions", "constraints_from", "precision_set", "study_model"]


class StudyModel(NamedTuple):
    """A study's model: its name, its zoo name (``""`` for a module of the user's), the
    module, its loss and its batches (``batch(seed=0)`` is ``(inputs, target)``)."""

    name: str
    zoo_name: str
    model: Any
    loss_fn: Any
    batch: Callable[..., tuple]


def study_model(model, example_batch: tuple | None = None, *, loss_fn=None,
                model_kwargs: Mapping[str, Any] | None = None,
                batch_size: int = 2) -> StudyModel:
    """``model`` (a zoo model name, built seeded, or an ``nn.Module`` with its
    ``example_batch``) with its loss (default: the zoo model's, else cross-entropy) and
    batches (a zoo model's seeded ones of ``batch_size``, else always ``example_batch``)."""
    import torch
    from torch import nn

    from qsync_lab.models import example_batch as zoo_batch
    from qsync_lab.models import get_model, model_spec

    kwargs = dict(model_kwargs or {})
    if isinstance(model, str):
        spec = model_spec(model)
        torch.manual_seed(0)
        return StudyModel(spec.name, spec.name, get_model(spec.name, **kwargs),
                          loss_fn or spec.loss_fn(),
                          functools.partial(zoo_batch, spec.name, batch_size, **kwargs))
    if isinstance(model, nn.Module):
        if example_batch is None:
            raise QSyncError("a Study of your own module needs its example_batch: "
                             "(inputs, target)")
        return StudyModel(type(model).__name__, "", model, loss_fn or nn.CrossEntropyLoss(),
                          lambda seed=0: example_batch)
    raise QSyncError(f"model must be a zoo model name or an nn.Module, got "
                     f"{type(model).__name__}")


def as_cluster(cluster: "str | os.PathLike[str] | Cluster") -> Cluster:
    """``cluster`` itself, or the shipped cluster of that name, or the one in that TOML."""
    return cluster if isinstance(cluster, Cluster) else load_cluster(cluster)


def calibration_count(requested: int, zoo_name: str) -> int:
    """How many batches the indicator averages over: ``requested`` for a zoo model, one (the
    example batch) for a module."""
    if requested < 1:
        raise QSyncError(f"calibration_batches must be at least 1, got {requested}")
    return requested if zoo_name else 1


def cluster_low_precisions(cluster: Cluster) -> tuple[Precision, ...]:
    """Every precision other than fp32 that some device kind of ``cluster`` runs."""
    kinds = [cluster.catalog.device(k) for k in cluster.device_kinds]
    return tuple(p for p in Precision
                 if p is not Precision.FP32 and any(d.supports(p) for d in kinds))


def precision_set(precisions: Iterable["Precision | str"]) -> tuple[Precision, ...]:
    """``precisions`` parsed, without repeats, in :class:`~qsync_lab.precision.Precision`
    order: ``precision_set(["int8", "fp16", "int8"])`` is ``(FP16, INT8)``."""
    return tuple(sorted({Precision.parse(p) for p in precisions}, key=list(Precision).index))


def constraints_from(memory_limit: "Mapping[str, float] | float | None",
                throughput_target: float | None, device_kinds: Iterable[str]) -> Constraints:
    """The :class:`~qsync_lab.constraints.Constraints` of a per-kind memory limit in GiB (or
    one for every kind of ``device_kinds``) and a throughput target."""
    if memory_limit is None or isinstance(memory_limit, Mapping):
        memory = dict(memory_limit or {})
    else:
        memory = dict.fromkeys(device_kinds, memory_limit)
    return Constraints(memory, throughput_target)


def allocation_strategy(name: str) -> Callable:
    """The allocation of strategy ``name`` (:data:`~qsync_lab.allocate.STRATEGIES`), or
    QSyncError listing the choices."""
    from qsync_lab.allocate import STRATEGIES

    if name not in STRATEGIES:
        raise QSyncError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]
