"""Figures of an operator graph: where the FLOPs are, and what DDP will all-reduce."""

import pandas as pd
import plotly.graph_objects as go

_PASSES = [("fwd_flops", "forward"), ("bwd_input_flops", "input gradient"),
           ("bwd_weight_flops", "weight gradient")]


def plot_flops_by_kind(graph, *, title: str | None = None) -> go.Figure:
    """Stacked bars of GFLOPs per operator kind, split into forward, input-gradient and
    weight-gradient work (kinds with no FLOPs are left out).

    Example::

        >>> import torch, torch.nn as nn
        >>> from qsync_lab.graph import trace_graph
        >>> fig = plot_flops_by_kind(trace_graph(nn.Linear(4, 2), torch.randn(3, 4)))
        >>> list(fig.data[0].x), list(fig.data[0].y)
        (['linear'], [5.4e-08])
    """
    per_kind = graph.ops.groupby("kind")[[col for col, _ in _PASSES]].sum()
    per_kind = per_kind[per_kind.sum(axis=1) > 0]
    per_kind = per_kind.loc[per_kind.sum(axis=1).sort_values(ascending=False).index]
    fig = go.Figure([go.Bar(name=label, x=list(per_kind.index), y=list(per_kind[col] / 1e9))
                     for col, label in _PASSES])
    fig.update_layout(barmode="stack", title=title or "GFLOPs per operator kind",
                      xaxis_title="operator kind", yaxis_title="GFLOP per iteration",
                      legend_title="pass")
    return fig


def plot_buckets(buckets: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Bar per DDP gradient bucket (in reduction order) with its size in MiB and how many
    parameters it holds; ``buckets`` is the frame :func:`qsync_lab.graph.ddp_buckets`
    returns.

    Example::

        >>> import pandas as pd
        >>> frame = pd.DataFrame({"bucket": [0, 0, 1], "param": ["a", "b", "c"],
        ...                       "bytes": [2**20, 2**20, 2**19], "dtype": ["float32"] * 3})
        >>> list(plot_buckets(frame).data[0].y)
        [2.0, 0.5]
    """
    per_bucket = buckets.groupby("bucket").agg(mib=("bytes", "sum"), params=("param", "size"))
    per_bucket["mib"] = per_bucket["mib"] / 2**20
    fig = go.Figure(go.Bar(x=list(per_bucket.index), y=list(per_bucket["mib"]),
                           customdata=list(per_bucket["params"]),
                           hovertemplate="bucket %{x}: %{y:.2f} MiB, %{customdata} params"))
    fig.update_layout(title=title or "DDP gradient buckets (reduction order)",
                      xaxis_title="bucket", yaxis_title="MiB")
    return fig
