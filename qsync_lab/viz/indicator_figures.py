"""Figures of the sensitivity indicator."""

import pandas as pd
import plotly.graph_objects as go

from qsync_lab.errors import QSyncError


def plot_indicator(scores: pd.DataFrame, precision: str, *, value: str = "risk",
                   gamma: float = 4.0, top: int | None = None,
                   title: str | None = None) -> go.Figure:
    """Per-op bars of the indicator at ``precision``: the ``risk`` the allocator minimises
    (the first-order Fisher term), or QSync's bi-directional ``omega``, split into the
    forward part ``γ·(L−d)·V_f`` and the backward part ``d·V_b`` (they stack to ω).

    Args:
        scores: the frame :func:`qsync_lab.indicator.indicator` returns.
        precision: which precision's scores to draw (a top-level column of ``scores``).
        value: ``"risk"`` or ``"omega"``.
        gamma: the γ the scores were computed with (to split ω into its parts).
        top: draw only the ``top`` ops with the largest value (default: all, in graph order).
        title: figure title.

    Example::

        >>> import pandas as pd
        >>> cols = pd.MultiIndex.from_tuples([("op", "kind"), ("op", "depth"),
        ...     ("int8", "V_f"), ("int8", "V_b"), ("int8", "omega"), ("int8", "risk")])
        >>> scores = pd.DataFrame([["linear", 0, 1.0, 5.0, 8.0, 0.3],
        ...                        ["linear", 2, 1.0, 1.0, 2.0, 0.1]],
        ...                       index=["fc1", "fc2"], columns=cols)
        >>> [(t.name, list(t.y)) for t in plot_indicator(scores, "int8").data]
        [('risk', [0.3, 0.1])]
        >>> fig = plot_indicator(scores, "int8", value="omega", gamma=1.0)
        >>> [(t.name, list(t.y)) for t in fig.data]
        [('forward', [8.0, 0.0]), ('backward', [0.0, 2.0])]
    """
    if precision not in scores.columns.get_level_values(0):
        choices = sorted(set(scores.columns.get_level_values(0)) - {"op"})
        raise QSyncError(f"no scores for precision {precision!r}; choose one of: "
                         f"{', '.join(choices)}")
    if value not in ("risk", "omega"):
        raise QSyncError(f"value must be 'risk' or 'omega', got {value!r}")
    shown = scores[(precision, value)]
    order = scores.index if top is None else shown.sort_values(ascending=False).index[:top]
    names = [str(op) for op in order]
    if value == "risk":
        fig = go.Figure([go.Bar(name="risk", x=names, y=list(shown.loc[order]))])
        fig.update_layout(title=title or f"Risk at {precision}: what the allocator "
                          "minimises (first-order Fisher term)", xaxis_title="operator",
                          yaxis_title="risk (expected loss increase)", showlegend=False)
        return fig
    backward = scores[("op", "depth")].astype(float) * scores[(precision, "V_b")]
    forward = shown - backward
    fig = go.Figure([
        go.Bar(name="forward", x=names, y=list(forward.loc[order])),
        go.Bar(name="backward", x=names, y=list(backward.loc[order])),
    ])
    fig.update_layout(barmode="stack", title=title or f"Indicator ω at {precision} "
                      f"(γ = {gamma:g}): forward γ·(L−d)·V_f and backward d·V_b",
                      xaxis_title="operator", yaxis_title="ω (error energy)",
                      legend_title="part")
    return fig
