"""The simulated iteration as a timeline: one row per (rank, stream), bars on a µs axis.

Bars are horizontal ``go.Bar(base=start_us, x=dur_us, orientation="h")`` on a numeric
axis (``px.timeline`` only has a date axis), one trace per colour group so the legend
toggles them.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.cluster import load_cluster
    >>> from qsync_lab.costs import CostModel
    >>> from qsync_lab.graph import trace_graph
    >>> from qsync_lab.simulate import simulate
    >>> graph = trace_graph(nn.Sequential(nn.Linear(16, 16), nn.ReLU()), torch.randn(4, 16))
    >>> sim = simulate(graph, {"T4": {"0": "fp16"}}, load_cluster("local-hybrid"), CostModel())
    >>> fig = plot_timeline(sim)
    >>> sorted(trace.name for trace in fig.data), fig.layout.xaxis.type
    (['fp16', 'fp32'], 'linear')
"""

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from qsync_lab.errors import QSyncError

__all__ = ["plot_timeline"]

_COLOR_COLUMNS = ("precision", "plan_precision", "category", "phase", "source", "stream")
_ROW_HEIGHT_PX = 28
_MIN_HEIGHT_PX = 250


def plot_timeline(sim, *, ranks: "list[int] | None" = None, color_by: str = "precision",
                  title: str | None = None) -> go.Figure:
    """Timeline of a :class:`~qsync_lab.simulate.SimResult`.

    Args:
        sim: the simulation result.
        ranks: ranks to draw (default: the first rank of each device kind and batch size;
            the other ranks of such a class have the same timeline).
        color_by: event column that picks the colour: ``precision``, ``plan_precision``,
            ``category``, ``phase``, ``source`` or ``stream``.
        title: figure title (default: iteration time).

    Returns:
        The figure (never shown).
    """
    if color_by not in _COLOR_COLUMNS:
        raise QSyncError(f"cannot colour by {color_by!r}; choose one of: "
                         f"{', '.join(_COLOR_COLUMNS)}")
    selected = _default_ranks(sim) if ranks is None else list(ranks)
    bad = [r for r in selected if not 0 <= r < sim.world_size]
    if bad:
        raise QSyncError(f"rank {bad[0]} is out of range; use 0..{sim.world_size - 1}")
    events = pd.concat([sim.rank_events(r) for r in selected], ignore_index=True)
    labels = [f"rank {r} ({sim.rank_devices[r]}) {stream}"
              for r, stream in zip(events["rank"], events["stream"])]
    events = events.assign(row=labels)
    row_order = list(dict.fromkeys(labels))
    fig = go.Figure()
    for value, group in events.groupby(color_by, sort=True):
        fig.add_trace(go.Bar(
            name=str(value), orientation="h", base=group["start_us"].to_numpy(),
            x=group["dur_us"].to_numpy(), y=group["row"].tolist(),
            customdata=np.stack([group["op"], group["phase"], group["source"]], axis=-1),
            hovertemplate="%{customdata[0]}<br>%{customdata[1]}, %{x:.1f} us from "
                          "%{base:.1f} us<br>source: %{customdata[2]}<extra>%{fullData.name}"
                          "</extra>"))
    fig.update_layout(
        barmode="overlay", title=title or f"one iteration: {sim.iteration_us / 1e3:.2f} ms",
        xaxis={"title": "time (us)", "type": "linear"},
        yaxis={"categoryorder": "array", "categoryarray": row_order[::-1]},
        legend_title=color_by, height=max(_MIN_HEIGHT_PX, _ROW_HEIGHT_PX * len(row_order) + 150))
    return fig


def _default_ranks(sim) -> list[int]:
    _, first = np.unique(sim.class_of_rank, return_index=True)
    return sorted(first.tolist())
