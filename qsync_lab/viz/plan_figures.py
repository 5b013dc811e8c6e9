"""Figures of plans: which precision each op runs in per device kind, and how the
strategies' plans compare."""

import re

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from qsync_lab.errors import QSyncError
from qsync_lab.viz.common import PRECISION_COLORS

__all__ = ["plot_comparison", "plot_precision_map"]

_COMPARE_COLUMNS = ("throughput_samples_per_s", "iteration_ms", "indicator_sum", "compression",
                    "meets_target")
_PER_KIND_PANELS = (("low_precision_ops", "low-precision ops per rank"),
                    ("tensor_peak_gib", "peak memory per rank (GiB)"))


def plot_precision_map(plan, graph, *, title: str | None = None) -> go.Figure:
    """Heatmap of the plan: one row per device kind, one column per plannable op of
    ``graph`` (graph order), coloured by the op's forward precision
    (:data:`~qsync_lab.viz.common.PRECISION_COLORS`); ops the plan leaves out run fp32.

    Example::

        >>> import torch, torch.nn as nn
        >>> from qsync_lab.cluster import load_cluster
        >>> from qsync_lab.graph import trace_graph
        >>> from qsync_lab.plan import Plan
        >>> graph = trace_graph(nn.Sequential(nn.Linear(16, 16), nn.ReLU()), torch.randn(4, 16))
        >>> plan = Plan.build(graph, load_cluster("local-hybrid"), {"T4": {"0": "fp16"}})
        >>> fig = plot_precision_map(plan, graph)
        >>> list(fig.data[0].y), fig.data[0].z, fig.data[0].colorbar.ticktext
        (['V100-SXM2-32GB', 'T4'], ([0], [1]), ('fp32', 'fp16'))
    """
    from qsync_lab.policy import PLANNABLE_KINDS, OpPrecision

    plan.validate(graph)
    ops = graph.ops.index[graph.ops["kind"].isin(list(PLANNABLE_KINDS))
                          & (graph.ops["plan_refusal"] == "")].tolist()
    fp32 = OpPrecision.parse("fp32")
    configs = [[plan.precisions[kind].get(op, fp32) for op in ops] for kind in plan.precisions]
    used = {str(c.forward) for row in configs for c in row}
    names = [p for p in PRECISION_COLORS if p in used]
    code = {p: i for i, p in enumerate(names)}
    colors = [PRECISION_COLORS[p] for p in names]
    fig = go.Figure(go.Heatmap(
        z=[[code[str(c.forward)] for c in row] for row in configs], x=ops, y=list(plan.precisions),
        customdata=[[str(c) for c in row] for row in configs],
        colorscale=[[edge / len(colors), c] for i, c in enumerate(colors) for edge in (i, i + 1)],
        zmin=-0.5, zmax=len(names) - 0.5, xgap=1, ygap=1,
        colorbar={"title": "precision", "tickvals": list(range(len(names))), "ticktext": names},
        hovertemplate="%{y}, %{x}: %{customdata}<extra></extra>"))
    fig.update_layout(title=title or f"per-op precision ({plan.strategy or 'plan'})",
                      xaxis_title="op (graph order)", yaxis_title="device kind")
    return fig


def plot_comparison(table: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Three panels over the strategies of
    :func:`~qsync_lab.allocate.compare_strategies` (or ``Study.compare()``, compression
    rows included): predicted throughput (hover: iteration time, summed indicator,
    compression; a strategy below the throughput target is labelled so), then per device
    kind the low-precision ops and the peak memory per rank.

    Example::

        >>> import pandas as pd
        >>> table = pd.DataFrame({"throughput_samples_per_s": [100.0, 150.0],
        ...     "iteration_ms": [32.0, 21.3], "low_precision_ops[T4]": [0, 12],
        ...     "indicator_sum": [0.0, 3.5], "tensor_peak_gib[T4]": [1.5, 1.1],
        ...     "batch[T4]": ["16", "16"], "compression": ["", ""],
        ...     "meets_target": [False, True]}, index=["fp32", "qsync"])
        >>> [(t.name, list(t.y)) for t in plot_comparison(table).data]
        [('throughput', [100.0, 150.0]), ('T4', [0, 12]), ('T4', [1.5, 1.1])]
    """
    kinds = [m[1] for c in table.columns if (m := re.fullmatch(r"tensor_peak_gib\[(.+)\]", c))]
    missing = [c for c in _COMPARE_COLUMNS if c not in table.columns]
    if missing or not kinds:
        raise QSyncError(f"not a compare_strategies table (no column "
                         f"{(missing or ['tensor_peak_gib[<kind>]'])[0]!r}); pass what "
                         "Study.compare() returns")
    strategies = table.index.astype(str).tolist()
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=["predicted throughput (samples/s)",
                                        *(label for _, label in _PER_KIND_PANELS)])
    fig.add_trace(go.Bar(
        name="throughput", showlegend=False,  # the legend names the device kinds
        x=strategies, y=table["throughput_samples_per_s"].tolist(),
        text=["" if ok else "below target" for ok in table["meets_target"]],
        customdata=table[["iteration_ms", "indicator_sum", "compression"]].to_numpy(),
        hovertemplate="%{x}: %{y:.1f} samples/s, %{customdata[0]:.2f} ms<br>indicator "
                      "sum %{customdata[1]:.3g}<br>compression: %{customdata[2]}"
                      "<extra></extra>"), 1, 1)
    for row, (prefix, _) in enumerate(_PER_KIND_PANELS, start=2):
        for i, kind in enumerate(kinds):
            fig.add_trace(go.Bar(name=kind, legendgroup=kind, showlegend=row == 2,
                                 x=strategies, y=table[f"{prefix}[{kind}]"].tolist(),
                                 marker_color=qualitative.Plotly[i % len(qualitative.Plotly)]),
                          row, 1)
    fig.update_layout(title=title or "strategies compared", height=750,
                      legend_title="device kind")
    return fig
