"""A :class:`~qsync_lab.study.Study`'s model run on this machine: scored by the indicator
(:mod:`qsync_lab.indicator`), profiled (:mod:`qsync_lab.profile`), and trained under a plan
on the local ranks with a prediction of what that run measures (:mod:`qsync_lab.runtime`).

Example::

    >>> from qsync_lab.cluster import load_cluster
    >>> (images,), labels = profile_batch("digits_mlp", {}, load_cluster("v100-t4-small"), None)
    >>> len(images) == len(labels) == load_cluster("v100-t4-small").ranks[0].batch_size
    True
    >>> [Path(p).name for p in profiles_with("mine.csv")]
    ['mine.csv', 'cpu.csv']
"""

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qsync_lab.cluster import Cluster
from qsync_lab.errors import QSyncError
from qsync_lab.plan import Plan
from qsync_lab.precision import Precision

__all__ = ["predict_local_run", "profile_batch", "profile_model", "profiles_with",
           "score_model", "train_plan"]


def score_model(model, graph, batches: Sequence, loss_fn,
                precisions: Sequence[Precision], *, progress: bool):
    """The sensitivity indicator of ``model`` over the calibration ``batches`` in
    ``precisions`` (:func:`~qsync_lab.indicator.indicator`), read from the disk cache when
    the model, batches and software are the same, else computed and kept there
    (:mod:`qsync_lab.indicator.cache`)."""
    from qsync_lab.indicator import indicator
    from qsync_lab.indicator.cache import cached_indicator, indicator_key

    key = indicator_key(model, graph, batches, loss_fn, precisions)
    return cached_indicator(key, lambda: indicator(
        model, graph, batches, loss_fn=loss_fn, precisions=precisions,
        num_batches=len(batches), progress=progress))


def profile_batch(zoo_name: str, model_kwargs: Mapping[str, Any], cluster: Cluster,
                  example: tuple | None) -> tuple:
    """The batch a model's ops are timed at: a zoo model's at its ranks' batch size when they
    share one (the rows then are the run's own, not scaled from the small example), else
    ``example``."""
    from qsync_lab.models import example_batch as zoo_batch

    sizes = {rank.batch_size for rank in cluster.ranks}
    if zoo_name and len(sizes) == 1:
        return zoo_batch(zoo_name, sizes.pop(), **model_kwargs)
    return example


def profile_model(name: str, model, batch: tuple, loss_fn, out: "str | os.PathLike[str]", *,
                  precisions: Sequence["Precision | str"], ranks: int, threads: int,
                  repeats: int, compression: Sequence[str], optimizer: str, progress: bool,
                  device: str):
    """Measure ``model``'s op costs at ``batch`` in fp32 and ``precisions`` into ``out``
    (:func:`~qsync_lab.profile.profile_machine`): on the CPU in ``ranks`` processes of
    ``threads`` each, on a GPU in one; with its step overhead under ``optimizer`` and the
    encode and decode of each ``compression`` spec, but no casts or links."""
    import torch

    from qsync_lab.compress import CompressionSpec
    from qsync_lab.profile import ProfileJob, profile_machine

    inputs, target = batch
    inputs = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
    return profile_machine([ProfileJob(name, model, inputs, target, loss_fn)], out,
                           precisions=["fp32", *(str(p) for p in precisions)],
                           threads=threads, repeats=repeats,
                           processes=ranks if torch.device(device).type == "cpu" else 1,
                           casts=False, links=None,
                           compression=[str(CompressionSpec.parse(c)) for c in compression],
                           step_optimizer=optimizer, progress=progress, device=device)


def profiles_with(out: "str | os.PathLike[str]") -> tuple[str, ...]:
    """The profiles a study reads once it has profiled into ``out``: ``out`` first, then the
    shipped CPU profile (casts, links and the default compressors)."""
    from qsync_lab.resources import data_file

    return str(out), str(data_file("profiles", "cpu.csv"))


def predict_local_run(plan: Plan, graph, costs, profiles: Sequence[str]):
    """What a local run of ``plan`` is predicted to measure
    (:func:`~qsync_lab.runtime.prediction.predict_plan`): with ``costs`` when they were read
    from ``profiles``, else with the shipped CPU profile, as the run's own summary."""
    from qsync_lab.costs import load_cost_model
    from qsync_lab.runtime.prediction import predict_plan, run_profiles

    return predict_plan(plan, graph, costs if profiles else load_cost_model(*run_profiles()))


def train_plan(plan: Plan, *, steps: int, run_dir: "str | os.PathLike[str]",
               profiles: tuple[str, ...], threads: int | None, verbose: bool, progress: bool,
               **options) -> dict[str, Any] | None:
    """Save ``plan`` as ``run_dir/plan.json``, train it on the local ranks of its cluster
    (:func:`~qsync_lab.runtime.launch.launch`; ``threads`` per rank, default torchrun's) and
    return the run's summary (None when nothing was trained)."""
    from qsync_lab.runtime.launch import launch
    from qsync_lab.runtime.lock import check_run_dir_free
    from qsync_lab.runtime.options import TrainConfig

    if not plan.model_name:
        raise QSyncError("Study.run trains zoo models; for your own module call "
                         "qsync_lab.runtime.train(..., task=Task(...)) on every rank "
                         "under torchrun")
    check_run_dir_free(run_dir)  # the plan of a run still going there is kept
    path = Path(run_dir) / "plan.json"
    if options.get("resume") and path.exists() and Plan.load(path).to_dict() != plan.to_dict():
        raise QSyncError(f"resume=True: {path} holds another plan, the one its checkpoints "
                         f"continue; resume with Plan.load({str(path)!r}) or pass another "
                         "run_dir")  # kept: that run can still resume
    plan.save(path)
    config = TrainConfig(plan=str(path), run_dir=str(run_dir), steps=steps,
                         profiles=profiles, **options)
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    return launch(config, threads=threads, env=env, verbose=verbose, progress=progress)
