"""Notebook widgets (ipywidgets and plotly ``FigureWidget``\\ s); importing this package
imports both, ``import qsync_lab`` does not.

* :class:`PlanTuner` — controls (cluster composition, memory budgets, throughput target,
  strategy, gradient compression), a plan summary and figures redrawn on each change
  (the strategy comparison when its tab is opened), export with the real cluster's
  command, and a local run drawn live;
* :func:`replan` — the same re-plan without widgets (:class:`TunerSettings` in,
  :class:`TunerResult` out), and :func:`compare_result`, its strategy comparison;
* :func:`reshape_cluster`, :func:`export_plan`, :func:`cluster_commands`,
  :class:`LocalRun`, :func:`read_new_metrics` — its parts.

Example::

    >>> from qsync_lab.cluster import load_cluster
    >>> kind_counts(reshape_cluster(load_cluster("local-hybrid"), counts={"T4": 3}))
    {'V100-SXM2-32GB': 1, 'T4': 3}
"""

from qsync_lab.widgets.controls import COMPRESSIONS, TunerControls
from qsync_lab.widgets.export import cluster_commands, export_plan
from qsync_lab.widgets.figures import replace_figure
from qsync_lab.widgets.local_run import LocalRun, read_new_metrics, runs_here
from qsync_lab.widgets.replan import FIGURES, TunerResult, TunerSettings, compare_result, replan
from qsync_lab.widgets.shape import kind_batch_sizes, kind_counts, reshape_cluster
from qsync_lab.widgets.summary import error_html, summary_html
from qsync_lab.widgets.tuner import COMPARISON_TAB, TABS, PlanTuner

__all__ = ["COMPARISON_TAB", "COMPRESSIONS", "FIGURES", "LocalRun", "PlanTuner", "TABS",
           "TunerControls", "TunerResult", "TunerSettings", "cluster_commands", "compare_result",
           "error_html", "export_plan", "kind_batch_sizes", "kind_counts", "read_new_metrics",
           "replace_figure", "replan", "reshape_cluster", "runs_here", "summary_html"]
