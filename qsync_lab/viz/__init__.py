"""Figure factories: each returns a ``plotly.graph_objects.Figure`` and never shows it.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.graph import trace_graph
    >>> fig = plot_flops_by_kind(trace_graph(nn.Linear(4, 2), torch.randn(3, 4)))
    >>> [trace.name for trace in fig.data]
    ['forward', 'input gradient', 'weight gradient']
"""

from qsync_lab.viz.common import PRECISION_COLORS
from qsync_lab.viz.graph_figures import plot_buckets, plot_flops_by_kind
from qsync_lab.viz.indicator_figures import plot_indicator
from qsync_lab.viz.memory import plot_memory
from qsync_lab.viz.plan_figures import plot_comparison, plot_precision_map
from qsync_lab.viz.prediction import plot_prediction
from qsync_lab.viz.timeline import plot_timeline
from qsync_lab.viz.training import plot_training

__all__ = ["PRECISION_COLORS", "plot_buckets", "plot_comparison", "plot_flops_by_kind",
           "plot_indicator", "plot_memory", "plot_precision_map", "plot_prediction",
           "plot_timeline", "plot_training"]
