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

from qsync_lab.runtime.tasks import Task, load_task
from qsync_lab.runtime.trainer import TrainConfig, train

__all__ = ["Task", "TrainConfig", "load_task", "train"]
