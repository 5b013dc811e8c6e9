"""Figures of a training run: loss and every rank's step time, step by step."""

import os
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

__all__ = ["plot_training"]


def plot_training(metrics: "list[dict] | str | os.PathLike[str]", *,
                  predicted_step_ms: float | None = None, title: str | None = None) -> go.Figure:
    """Two panels over the steps: the global training loss, and each rank's step time
    (with the simulator's prediction as a dashed line when given).

    ``metrics`` is a run folder, its ``metrics.jsonl``, or the records
    :func:`qsync_lab.runtime.metrics.read_metrics` returns.

    Example::

        >>> records = [{"step": s, "loss": 1.0 / (s + 1), "step_ms": [10.0, 12.0 + s]}
        ...            for s in range(3)]
        >>> fig = plot_training(records, predicted_step_ms=11.0)
        >>> [trace.name for trace in fig.data]
        ['loss', 'rank 0', 'rank 1', 'predicted']
        >>> list(fig.data[2].y)
        [12.0, 13.0, 14.0]
    """
    if not isinstance(metrics, list):
        from qsync_lab.runtime.metrics import read_metrics

        path = Path(metrics)
        metrics = read_metrics(path / "metrics.jsonl" if path.is_dir() else path)
    steps = [r["step"] for r in metrics]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("training loss (global batch)", "step time per rank"))
    fig.add_trace(go.Scatter(x=steps, y=[r["loss"] for r in metrics], name="loss"), 1, 1)
    ranks = len(metrics[0]["step_ms"]) if metrics else 0
    for rank in range(ranks):
        fig.add_trace(go.Scatter(x=steps, y=[r["step_ms"][rank] for r in metrics],
                                 name=f"rank {rank}", mode="lines"), 2, 1)
    if predicted_step_ms is not None and steps:
        fig.add_trace(go.Scatter(x=[steps[0], steps[-1]], y=[predicted_step_ms] * 2,
                                 name="predicted", mode="lines", line={"dash": "dash"}), 2, 1)
    fig.update_yaxes(title_text="loss", row=1, col=1)
    fig.update_yaxes(title_text="ms", type="log", row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(title=title or "training run", height=600)
    return fig
