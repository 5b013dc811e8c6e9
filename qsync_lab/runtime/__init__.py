"""The DDP runner: train a plan on every rank of a torchrun job.

``torchrun … -m qsync_lab.runtime --plan plan.json`` (or ``qsync-lab run --plan plan.json``)
calls :func:`train` on every rank: the rank applies its device kind's precisions
(:mod:`qsync_lab.quant`), trains under DDP with uneven per-rank batches weighted to the
global-batch gradient, writes ``metrics.jsonl`` and atomic checkpoints, resumes exactly,
and ends with a summary of measured against predicted step time
(:mod:`qsync_lab.runtime.trainer`). Your own model and data: a :class:`Task`.

Example::

    >>> from qsync_lab.runtime import load_task
    >>> task = load_task("digits", "digits_cnn")
    >>> task.name, tuple(task.example(4)[0][0].shape)
    ('digits', (4, 1, 8, 8))
"""

import importlib

_EXPORTS = {"Task": "qsync_lab.runtime.tasks", "load_task": "qsync_lab.runtime.tasks",
            "TrainConfig": "qsync_lab.runtime.options", "train": "qsync_lab.runtime.trainer",
            "exit_rank": "qsync_lab.runtime.rank_exit"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):  # light to import: ``qsync-lab run`` checks options before torch
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qsync_lab.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
