"""The simulated iteration as a timeline: one row per (rank, stream), bars on a µs axis.

Bars are horizontal ``go.Bar(base=start_us, x=dur_us, orientation="h")`` on a numeric
axis (``px.timeline`` only has a date axis), one trace per colour group so the legend
toggles them. Precisions keep their :data:`~qsync_lab.viz.common.PRECISION_COLORS`, casts
are hatched ``/`` and compressed allreduces ``x`` whatever the colouring, and a light
``idle`` trace marks where each compute stream waits.

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
    (['fp16', 'fp32', 'idle'], 'linear')
"""

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from qsync_lab.errors import QSyncError
from qsync_lab.viz.common import PRECISION_COLORS, rank_label, selected_ranks

__all__ = ["plot_timeline"]

_COLOR_COLUMNS = ("precision", "plan_precision", "category", "phase", "source", "stream")
_CATEGORY_PATTERNS = {"cast": "/", "compressed": "x"}
_IDLE_COLOR = "rgba(128, 128, 128, 0.15)"
_MIN_IDLE_US = 1e-3  # shorter gaps are rounding between back-to-back events
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
    selected = selected_ranks(sim, ranks)
    events = pd.concat([sim.rank_events(r) for r in selected], ignore_index=True)
    labels = [f"{rank_label(sim, r)} {stream}"
              for r, stream in zip(events["rank"], events["stream"])]
    events = events.assign(row=labels)
    row_order = list(dict.fromkeys(labels))
    fig = go.Figure()
    by_precision = color_by in ("precision", "plan_precision")
    for value, group in events.groupby(color_by, sort=True):
        patterns = group["category"].map(_CATEGORY_PATTERNS).fillna("").tolist()
        # events with no value of the column (DDP's buffer broadcast has no precision) are
        # named by their category
        name = str(value) or "/".join(sorted(set(group["category"])))
        fig.add_trace(go.Bar(
            name=name, orientation="h", base=group["start_us"].to_numpy(),
            x=group["dur_us"].to_numpy(), y=group["row"].tolist(),
            marker={"color": PRECISION_COLORS.get(str(value)) if by_precision else None,
                    "pattern_shape": patterns},
            customdata=np.stack([group["op"], group["category"], group["phase"],
                                 group["source"]], axis=-1),
            hovertemplate="%{customdata[0]}<br>%{customdata[1]}, %{customdata[2]}, %{x:.1f} "
                          "us from %{base:.1f} us<br>source: %{customdata[3]}<extra>"
                          "%{fullData.name}</extra>"))
    idle = _idle_gaps(events, sim.iteration_us)
    if len(idle):
        fig.add_trace(go.Bar(name="idle", orientation="h", base=idle["start_us"].to_numpy(),
                             x=idle["dur_us"].to_numpy(), y=idle["row"].tolist(),
                             marker_color=_IDLE_COLOR,
                             hovertemplate="idle %{x:.1f} us from %{base:.1f} us<extra></extra>"))
    fig.update_layout(
        barmode="overlay", title=title or f"one iteration: {sim.iteration_us / 1e3:.2f} ms",
        xaxis={"title": "time (us)", "type": "linear"},
        yaxis={"categoryorder": "array", "categoryarray": row_order[::-1]},
        # a legend row under the axis: beside a few rows a vertical legend scrolls
        legend={"title": color_by, "orientation": "h", "yanchor": "top", "y": -0.3},
        height=max(_MIN_HEIGHT_PX, _ROW_HEIGHT_PX * len(row_order) + 190))
    return fig


def _idle_gaps(events: pd.DataFrame, iteration_us: float) -> pd.DataFrame:
    """Per compute row of ``events`` (start-ordered, with a ``row`` column), where it waits
    between 0 and ``iteration_us``: columns ``row``, ``start_us``, ``dur_us``.

    Example::

        >>> events = pd.DataFrame({"row": ["r"] * 2, "stream": ["compute"] * 2,
        ...                        "start_us": [0.0, 5.0], "dur_us": [2.0, 1.0]})
        >>> _idle_gaps(events, 10.0)[["start_us", "dur_us"]].values.tolist()
        [[2.0, 3.0], [6.0, 4.0]]
    """
    found = []
    for row, group in events[events["stream"] == "compute"].groupby("row", sort=False):
        start_us = group["start_us"].to_numpy()
        ends_us = np.maximum.accumulate(start_us + group["dur_us"].to_numpy())
        begin_us = np.append(0.0, ends_us)
        gap_us = np.append(start_us, iteration_us) - begin_us
        keep = gap_us > _MIN_IDLE_US
        found += [(row, b, d) for b, d in zip(begin_us[keep], gap_us[keep])]
    return pd.DataFrame(found, columns=["row", "start_us", "dur_us"])
