"""The simulated peak memory of each rank, by component, against its device's memory."""

from collections.abc import Mapping

import plotly.graph_objects as go

from qsync_lab.devices import BYTES_PER_GIB
from qsync_lab.errors import QSyncError
from qsync_lab.viz.common import rank_label, selected_ranks

__all__ = ["plot_memory"]

_FAR_LIMIT = 3.0  # a limit over 3x the bars (or the smallest limit) is off the axis
_LIMIT_MARKER = {"symbol": "line-ew", "size": 40, "line": {"width": 3, "color": "black"}}


def plot_memory(sim, cluster, *, memory_gib: Mapping[str, float] | None = None,
                ranks: "list[int] | None" = None, title: str | None = None) -> go.Figure:
    """One bar per rank: its simulated peak memory stacked by component (the simulator's
    :data:`~qsync_lab.simulate.MEMORY_COMPONENTS`, in GiB), with a marker at its limit.

    Args:
        sim: the :class:`~qsync_lab.simulate.SimResult`.
        cluster: the cluster it simulated (the limits are its devices' memory).
        memory_gib: per device kind, a per-rank budget in GiB to draw as the limit instead
            of the simulation's (:attr:`~qsync_lab.simulate.SimResult.memory_budget_bytes`:
            the plan's budgets, else the device's memory).
        ranks: ranks to draw (default: the first rank of each class of ranks).
        title: figure title.

    Example::

        >>> import torch, torch.nn as nn
        >>> from qsync_lab.cluster import load_cluster
        >>> from qsync_lab.graph import trace_graph
        >>> from qsync_lab.simulate import simulate
        >>> graph = trace_graph(nn.Sequential(nn.Linear(16, 16), nn.ReLU()), torch.randn(4, 16))
        >>> cluster = load_cluster("local-hybrid")
        >>> fig = plot_memory(simulate(graph, {}, cluster), cluster, memory_gib={"T4": 8})
        >>> fig.data[-1].name, list(fig.data[-1].y)
        ('limit', [32.0, 8.0])
    """
    from qsync_lab.constraints import Constraints

    if tuple(r.device for r in cluster.ranks) != sim.rank_devices:
        raise QSyncError(f"cluster {cluster.name!r} is not the one simulated (ranks "
                         f"{', '.join(sim.rank_devices)}); pass the simulated cluster")
    selected = selected_ranks(sim, ranks)
    labels = [rank_label(sim, r) for r in selected]
    used_gib = sim.memory_breakdown.loc[selected] / BYTES_PER_GIB
    fig = go.Figure([go.Bar(name=component, x=labels, y=used_gib[component].tolist(),
                            hovertemplate="%{x}: %{y:.3f} GiB")
                     for component in used_gib.columns])
    given = Constraints(dict(memory_gib or {})).for_cluster(cluster).memory_gib
    limit_gib = [given.get(sim.rank_devices[r], sim.memory_budget_bytes.iloc[r] / BYTES_PER_GIB)
                 for r in selected]
    fig.add_trace(go.Scatter(name="limit", x=labels, y=limit_gib, mode="markers",
                             marker=_LIMIT_MARKER, hovertemplate="%{x}: limit %{y:.1f} GiB"))
    fig.update_layout(barmode="stack", title=title or "simulated peak memory per rank",
                      xaxis_title="rank", yaxis_title="GiB", legend_title="component")
    _scale_to_budget(fig, labels, float(used_gib.sum(axis=1).max()), limit_gib)
    return fig


def _scale_to_budget(fig: go.Figure, labels: list[str], used_gib: float,
                     limit_gib: list[float]) -> None:
    """Scale the axis to the bars and the limits near them (a 1 GiB budget beside a 32 GiB
    card would leave its bars flat); a limit above the axis is written at its top."""
    near = [g for g in limit_gib if g <= _FAR_LIMIT * max(used_gib, min(limit_gib))]
    top = 1.15 * max(used_gib, *near)
    fig.update_yaxes(range=[0, top])
    for label, gib in zip(labels, limit_gib):
        if gib > top:
            fig.add_annotation(x=label, y=top, yanchor="top", showarrow=False,
                               text=f"limit {gib:g} GiB ↑")
