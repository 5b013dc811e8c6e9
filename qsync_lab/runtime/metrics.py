"""``metrics.jsonl``: one JSON object per training step, appended and flushed by rank 0.

A resumed run first cuts the file back to the steps before its checkpoint (atomically),
so the file always reads as one run, step after step, whatever restarts happened.

Example::

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
    >>> with MetricsLog(path) as log:
    ...     for step in range(3):
    ...         log.write({"step": step, "loss": 1.0 / (step + 1)})
    >>> with MetricsLog(path, resume_step=2) as log:   # a restart from the step-2 checkpoint
    ...     log.write({"step": 2, "loss": 0.3})
    >>> [(r["step"], r["loss"]) for r in read_metrics(path)]
    [(0, 1.0), (1, 0.5), (2, 0.3)]
"""

import json
import os
from pathlib import Path
from typing import Any

from qsync_lab.io import atomic_write_text

__all__ = ["MetricsLog", "read_metrics"]


class MetricsLog:
    """Append-only step log; ``resume_step`` drops the records of steps ≥ it first."""

    def __init__(self, path: "str | os.PathLike[str]", resume_step: int = 0) -> None:
        self.path = Path(path)
        kept = [r for r in read_metrics(self.path) if r["step"] < resume_step] \
            if resume_step and self.path.exists() else []
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: "str | os.PathLike[str]") -> list[dict[str, Any]]:
    """The records of a metrics file; a line cut short by a crash is skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
