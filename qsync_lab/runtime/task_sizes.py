"""The bundled tasks' sizes and the zoo models' default tasks, light to import (no torch):
``qsync-lab run`` checks a plan's global batch against a task's training set before any
process starts (:func:`~qsync_lab.runtime.machine.check_data`);
:mod:`~qsync_lab.runtime.tasks` builds the tasks at these sizes.

Example::

    >>> default_task_name("BERT_mini"), default_task_name("resnet18"), TRAIN_SAMPLES["synthetic"]
    ('tokens', 'synthetic', 512)
"""

__all__ = ["DEFAULT_TASKS", "SYNTHETIC_SAMPLES", "TOKEN_SAMPLES", "TRAIN_SAMPLES",
           "ZIPF_TOKEN_SAMPLES", "default_task_name"]

#: model -> its bundled task; every other zoo model trains on ``synthetic``
DEFAULT_TASKS = {"digits_cnn": "digits", "digits_mlp": "mnist1d", "bert_mini": "tokens",
                 "bert_base": "tokens"}
#: (train, test) samples of the tasks generated here
SYNTHETIC_SAMPLES = (512, 128)
TOKEN_SAMPLES = (4096, 1024)
ZIPF_TOKEN_SAMPLES = (4096, 1024)
#: task -> training samples (digits: scikit-learn's 1797 images less the 25 % test split;
#: mnist1d: the mnist1d package's default dataset)
TRAIN_SAMPLES = {"digits": 1347, "mnist1d": 4000, "tokens": TOKEN_SAMPLES[0],
                 "synthetic": SYNTHETIC_SAMPLES[0], "zipf_tokens": ZIPF_TOKEN_SAMPLES[0]}


def default_task_name(model: str) -> str:
    """The bundled task zoo model ``model`` (any case) trains on by default."""
    return DEFAULT_TASKS.get(str(model).strip().lower(), "synthetic")
