"""``metrics.jsonl``: one JSON object per training step, appended and flushed by rank 0.

A resumed run first cuts the file back to the steps before its checkpoint (atomically),
so the file always reads as one run, step after step, whatever restarts happened. Every
line is strict JSON (:func:`strict_json`): a non-finite figure is written as null.

Example::

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
    >>> with MetricsLog(path) as log:
    ...     for step in range(3):
    ...         log.write({"step": step, "loss": 1.0 / (step + 1)})
    >>> with MetricsLog(path, resume_step=2) as log:   # a restart from the step-2 checkpoint
    ...     log.write({"step": 2, "loss": float("nan")})
    >>> [(r["step"], r["loss"]) for r in read_metrics(path)]
    [(0, 1.0), (1, 0.5), (2, None)]
"""

import json
import math
import os
from pathlib import Path
from typing import Any

from qsync_lab.io import atomic_write_text

__all__ = ["MetricsLog", "read_metrics", "strict_json", "summary_line", "result_text"]


class MetricsLog:
    """Append-only step log; ``resume_step`` drops the records of steps ≥ it first."""

    def __init__(self, path: "str | os.PathLike[str]", resume_step: int = 0) -> None:
        self.path = Path(path)
        kept = [r for r in read_metrics(self.path) if r["step"] < resume_step] \
            if resume_step and self.path.exists() else []
        atomic_write_text(self.path, "".join(strict_json(r) + "\n" for r in kept))
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(strict_json(record) + "\n")
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


def strict_json(document: Any, **dumps_options: Any) -> str:
    """``document`` as strict JSON (no NaN or Infinity tokens): a non-finite float is null.

    Example::

        >>> strict_json({"loss": float("nan"), "step_ms": [1.5, float("inf")], "accuracy": None})
        '{"loss": null, "step_ms": [1.5, null], "accuracy": null}'
    """
    return json.dumps(_finite_or_null(document), allow_nan=False, **dumps_options)


def summary_line(summary: dict[str, Any]) -> str:
    """A run's ``summary.json`` in one line: the result, measured against predicted (for
    this CPU when it emulated the plan's kinds), and what the plan was made under.

    Example::

        >>> summary_line({"model": "digits_cnn", "cluster": "local-cpu", "steps": 5,
        ...     "test_accuracy": None, "test_loss": 0.25, "measured_step_ms": 4.0,
        ...     "predicted_step_ms": 3.8, "step_error_pct": -5.0,
        ...     "measured_tensor_peak_mib": 2.0, "predicted_tensor_peak_mib": 2.1})
        'digits_cnn on local-cpu: 5 steps, test loss 0.2500; step time measured 4.00 ms, predicted 3.80 ms (-5.0 %); tensor peak measured 2.0 MiB, predicted 2.1 MiB'

    Skipped steps (``--on-nonfinite skip``) are counted: ``…: 5 steps (3 non-finite steps
    skipped), test loss …``; an emulated run says ``predicted for this CPU emulating
    V100-SXM2-32GB/T4 …``; ``plan_made_under`` is appended as ``; plan: …``.
    """
    skipped = summary.get("nonfinite_steps_skipped") or 0
    steps = f"{summary['steps']} steps" + (
        f" ({skipped} non-finite step{'s' if skipped > 1 else ''} skipped)" if skipped else "")
    emulating = summary.get("emulating")
    where = f" for this CPU emulating {'/'.join(emulating)}" if emulating else ""
    line = (f"{summary['model']} on {summary['cluster']}: {steps}, {result_text(summary)}; "
            f"step time measured {summary['measured_step_ms']:.2f} ms, predicted{where} "
            f"{summary['predicted_step_ms']:.2f} ms ({summary['step_error_pct']:+.1f} %); "
            f"tensor peak measured {summary['measured_tensor_peak_mib']:.1f} MiB, predicted "
            f"{summary['predicted_tensor_peak_mib']:.1f} MiB")
    made_under = summary.get("plan_made_under")
    return f"{line}; plan: {made_under}" if made_under else line


def result_text(summary: dict[str, Any]) -> str:
    """The test figure of a summary, with what it means: accuracy beside chance (the most
    frequent test label's share), none on the synthetic task (its labels are random).

    Example::

        >>> result_text({"task": "digits", "steps": 20, "test_accuracy": 0.08,
        ...              "chance_accuracy": 0.1, "test_loss": 2.3})
        'test accuracy 0.0800, not above chance (0.1000): not learned in 20 steps'
        >>> result_text({"task": "synthetic", "test_accuracy": 0.0, "test_loss": 2.4})
        'test loss 2.4000 (no accuracy: the synthetic task has random labels, it times runs)'
    """
    accuracy, loss = summary.get("test_accuracy"), summary.get("test_loss")
    chance = summary.get("chance_accuracy")
    if summary.get("task") == "synthetic":
        shown = f"test loss {loss:.4f} " if loss is not None else ""
        return f"{shown}(no accuracy: the synthetic task has random labels, it times runs)"
    if accuracy is not None and chance is not None:
        if accuracy <= chance:
            return (f"test accuracy {accuracy:.4f}, not above chance ({chance:.4f}): not "
                    f"learned in {summary['steps']} steps")
        return f"test accuracy {accuracy:.4f} (chance {chance:.4f})"
    return (f"test accuracy {accuracy:.4f}" if accuracy is not None
            else f"test loss {loss:.4f}" if loss is not None else "no test figure")


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_null(item) for item in value]
    return value
