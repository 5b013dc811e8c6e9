"""Predicted against measured: the simulator's step time or peak memory beside a run's."""

from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go

from qsync_lab.errors import QSyncError

__all__ = ["plot_prediction"]

#: metric -> (axis title, column pairs (measured, predicted): a run's summary.json,
#: then benchmarks/predictor_accuracy.py's runs.csv)
_METRICS = {
    "step_ms": ("step time (ms)", [("measured_step_ms", "predicted_step_ms"),
                                   ("step_ms", "pred_ms")]),
    "tensor_peak_mib": ("peak tensor memory (MiB)",
                        [("measured_tensor_peak_mib", "predicted_tensor_peak_mib"),
                         ("peak_MiB", "pred_MiB")]),
}
_LABEL_COLUMNS = ("model", "plan")


def plot_prediction(runs: "dict | Sequence[dict] | pd.DataFrame", *, metric: str = "step_ms",
                    labels: Sequence[str] | None = None, title: str | None = None) -> go.Figure:
    """A measured and a predicted bar per run, the prediction's error (%) written on it.

    Args:
        runs: a run's summary (what ``Study.run`` and :func:`qsync_lab.runtime.launch`
            return), a list of them, or a frame of such rows or of
            ``benchmarks/predictor_accuracy.py``'s ``runs.csv`` rows.
        metric: ``step_ms`` or ``tensor_peak_mib``.
        labels: one name per row (default: its ``model`` and ``plan`` columns, else
            ``run <i>``); rows of one name are drawn as their medians (a benchmark's rounds).
        title: figure title.

    Example::

        >>> runs = [{"model": "mlp", "measured_step_ms": 10.0, "predicted_step_ms": 11.0},
        ...         {"model": "cnn", "measured_step_ms": 20.0, "predicted_step_ms": 19.0}]
        >>> fig = plot_prediction(runs)
        >>> [(t.name, list(t.x), list(t.y)) for t in fig.data]
        [('measured', ['mlp', 'cnn'], [10.0, 20.0]), ('predicted', ['mlp', 'cnn'], [11.0, 19.0])]
        >>> list(fig.data[1].text)
        ['+10.0 %', '-5.0 %']
    """
    if metric not in _METRICS:
        raise QSyncError(f"unknown metric {metric!r}; choose one of: {', '.join(_METRICS)}")
    frame = pd.DataFrame([runs] if isinstance(runs, dict) else runs)
    axis_title, pairs = _METRICS[metric]
    found = [pair for pair in pairs if set(pair) <= set(frame.columns)]
    if not found:
        raise QSyncError(f"the runs have no {metric} pair (columns {pairs[0][0]!r} and "
                         f"{pairs[0][1]!r}, or {pairs[1][0]!r} and {pairs[1][1]!r})")
    if labels is not None and len(labels) != len(frame):
        raise QSyncError(f"{len(labels)} labels for {len(frame)} runs; give one per run")
    values = frame[list(found[0])].set_axis(["measured", "predicted"], axis=1)
    values.index = pd.Index(labels if labels is not None else _labels(frame), name="run")
    values = values.groupby(level=0, sort=False).median()
    error_pct = 100 * (values["predicted"] - values["measured"]) / values["measured"]
    names = values.index.tolist()
    fig = go.Figure([
        go.Bar(name="measured", x=names, y=values["measured"].tolist()),
        go.Bar(name="predicted", x=names, y=values["predicted"].tolist(),
               text=[f"{e:+.1f} %" for e in error_pct], textposition="outside"),
    ])
    fig.update_layout(barmode="group", title=title or f"predicted vs measured {axis_title}",
                      xaxis_title="run", yaxis_title=axis_title)
    return fig


def _labels(frame: pd.DataFrame) -> list[str]:
    """Each row's ``model`` and ``plan`` values (those present), else ``run <i>``."""
    columns = [c for c in _LABEL_COLUMNS if c in frame.columns]
    if not columns:
        return [f"run {i}" for i in range(len(frame))]
    return frame[columns].astype(str).agg(" ".join, axis=1).tolist()
