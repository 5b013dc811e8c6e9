"""Figures of the sensitivity indicator."""

import pandas as pd
import plotly.graph_objects as go

from qsync_lab.errors import QSyncError


def plot_indicator(scores: pd.DataFrame, precision: str, *, gamma: float = 4.0,
                   top: int | None = None, title: str | None = None) -> go.Figure:
    """Per-op bars of the bi-directional indicator at ``precision``, split into the
    forward part ``γ·(L−d)·V_f`` and the backward part ``d·V_b`` (they stack to ω).

    Args:
        scores: the frame :func:`qsync_lab.indicator.indicator` returns.
        precision: which precision's scores to draw (a top-level column of ``scores``).
        gamma: the γ the scores were computed with (to split ω into its parts).
        top: draw only the ``top`` ops with the largest ω (default: all, in graph order).
        title: figure title.

    Example::

        >>> import pandas as pd
        >>> cols = pd.MultiIndex.from_tuples([("op", "kind"), ("op", "depth"),
        ...     ("int8", "V_f"), ("int8", "V_b"), ("int8", "omega")])
        >>> scores = pd.DataFrame([["linear", 0, 1.0, 5.0, 8.0], ["linear", 2, 1.0, 1.0, 2.0]],
        ...                       index=["fc1", "fc2"], columns=cols)
        >>> fig = plot_indicator(scores, "int8", gamma=1.0)
        >>> [(t.name, list(t.y)) for t in fig.data]
        [('forward', [8.0, 0.0]), ('backward', [0.0, 2.0])]
    """
    if precision not in scores.columns.get_level_values(0):
        choices = sorted(set(scores.columns.get_level_values(0)) - {"op"})
        raise QSyncError(f"no scores for precision {precision!r}; choose one of: "
                         f"{', '.join(choices)}")
    depth = scores[("op", "depth")].astype(float)
    omega = scores[(precision, "omega")]
    backward = depth * scores[(precision, "V_b")]
    forward = omega - backward
    order = scores.index if top is None else omega.sort_values(ascending=False).index[:top]
    names = [str(op) for op in order]
    fig = go.Figure([
        go.Bar(name="forward", x=names, y=list(forward.loc[order])),
        go.Bar(name="backward", x=names, y=list(backward.loc[order])),
    ])
    fig.update_layout(barmode="stack", title=title or f"Indicator ω at {precision} "
                      f"(γ = {gamma:g}): forward γ·(L−d)·V_f and backward d·V_b",
                      xaxis_title="operator", yaxis_title="ω (error energy)",
                      legend_title="part")
    return fig
