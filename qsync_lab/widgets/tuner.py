"""``PlanTuner``: a notebook panel that re-plans a study as its controls change.

Each change of a control re-plans once (:func:`~qsync_lab.widgets.replan.replan`) and
redraws the summary and the figures in place; while it computes, the last result stays
shown, and a setting without a plan shows its one-line error above the last feasible plan,
whose figures stay. The plan exports to a folder with the command for the real cluster,
and trains on this machine's emulated ranks with its loss and step time drawn live.

Example::

    >>> tuner = PlanTuner(model="digits_cnn", cluster="local-hybrid", progress=False)
    >>> tuner.controls.strategy.value = "uniform-low"
    >>> tuner.result.plan.low_precision_ops()
    {'V100-SXM2-32GB': 0, 'T4': 6}
    >>> tuner.controls.strategy.value = "qsync"
    >>> tuner.controls.throughput.value = tuner.controls.throughput.max  # out of reach
    >>> print(tuner.summary.value[:83])
    <div style="color:#c0392b"><b>no plan reaches the throughput target: best reachable
    >>> tuner.result.settings.strategy, tuner.result.settings.throughput_samples_per_s
    ('qsync', None)
"""

import html
import os
import tempfile
import threading
from pathlib import Path

import ipywidgets as widgets
import plotly.graph_objects as go

from qsync_lab.errors import QSyncError
from qsync_lab.study import Study
from qsync_lab.viz import plot_training
from qsync_lab.widgets.controls import TunerControls
from qsync_lab.widgets.export import cluster_commands, export_plan
from qsync_lab.widgets.figures import replace_figure
from qsync_lab.widgets.local_run import LocalRun
from qsync_lab.widgets.replan import FIGURES, TunerResult, TunerSettings, replan
from qsync_lab.widgets.summary import error_html, summary_html

__all__ = ["PlanTuner"]

#: the throughput slider reaches this many times the first plan's throughput
THROUGHPUT_RANGE = 4.0
DEFAULT_STEPS = 30
RUNS_FOLDER = "tuner_runs"
_TAB_TITLES = {"timeline": "timeline", "memory": "memory", "indicator": "indicator",
               "comparison": "strategies", "precision_map": "precision map"}


class PlanTuner:
    """Controls, a plan summary and figures for one study (see the module docstring).

    Args:
        study: the study to tune; or give ``model`` (and ``cluster``, ``study_options``)
            to make one.
        model: a zoo model name or an ``nn.Module`` for a new :class:`~qsync_lab.Study`.
        cluster: its cluster (a shipped name, a TOML path or a Cluster).
        root: the folder exports go into (a folder name inside it) and local runs under
            (``root/tuner_runs``).
        study_options: :class:`~qsync_lab.Study`'s other keyword arguments.

    Attributes:
        controls: the :class:`~qsync_lab.widgets.controls.TunerControls`.
        summary: the plan summary (``HTML``).
        timeline, memory, indicator, comparison, precision_map: the figures
            (``go.FigureWidget``).
        result: the last feasible :class:`~qsync_lab.widgets.replan.TunerResult`.
        export_folder, export_button, export_status: the export (``Text``, ``Button``,
            ``HTML``).
        steps, run_button, cancel_button, run_status, live: the local run (``BoundedIntText``,
            two ``Button``\\ s, ``HTML``, ``go.FigureWidget`` of loss and step time).
        local_run, run_thread: the last local run and the thread that follows it.
        panel: everything, laid out (what the notebook shows).

    Raises:
        QSyncError: neither or both of ``study`` and ``model``, or the study has no plan
            at its default constraints.
    """

    def __init__(self, study: Study | None = None, *, model=None, cluster="local-hybrid",
                 root: "str | os.PathLike[str]" = ".", **study_options) -> None:
        if (study is None) == (model is None):
            raise QSyncError("give PlanTuner a Study, or model=... (a zoo name or a module)")
        self.study = study if study is not None else Study(model, cluster=cluster,
                                                           **study_options)
        self.root = Path(root)
        self._variants: dict[str, Study] = {}
        self.result: TunerResult = replan(self.study, TunerSettings(), variants=self._variants)
        self.controls = TunerControls.for_study(
            self.study, throughput_max=THROUGHPUT_RANGE * self.result.sim.throughput_samples_per_s)
        self.summary = widgets.HTML(summary_html(self.result))
        self.timeline, self.memory, self.indicator, self.comparison, self.precision_map = (
            go.FigureWidget(self.result.figures.get(name)) for name in FIGURES)
        for control in self.controls.all():
            control.observe(self._replan, names="value")
        self.export_folder = widgets.Text("qsync_export", description="folder in root")
        self.export_button = widgets.Button(description="Export plan", icon="save")
        self.export_status = widgets.HTML()
        self.export_button.on_click(self._export)
        self.steps = widgets.BoundedIntText(DEFAULT_STEPS, min=1, max=10**6, description="steps")
        self.run_button = widgets.Button(description="Run locally", icon="play")
        self.cancel_button = widgets.Button(description="Cancel", icon="stop", disabled=True)
        self.run_status = widgets.HTML()
        self.live = go.FigureWidget(plot_training([]))
        self.run_button.on_click(self._start_run)
        self.cancel_button.on_click(self._cancel_run)
        self.local_run: LocalRun | None = None
        self.run_thread: threading.Thread | None = None
        self.panel = self._layout()

    def display(self) -> None:
        """Show the panel in the notebook."""
        from IPython.display import display

        display(self.panel)

    def _repr_mimebundle_(self, **kwargs):
        return self.panel._repr_mimebundle_(**kwargs)

    def _figure_widgets(self) -> dict[str, go.FigureWidget]:
        return {name: getattr(self, name) for name in FIGURES}

    def _layout(self) -> widgets.VBox:
        export = widgets.VBox([widgets.HBox([self.export_folder, self.export_button]),
                               self.export_status])
        run = widgets.VBox([widgets.HBox([self.steps, self.run_button, self.cancel_button]),
                            self.run_status, self.live])
        figures = self._figure_widgets()
        tabs = widgets.Tab(children=[*figures.values(), export, run],
                           titles=[*(_TAB_TITLES[n] for n in figures), "export", "run locally"])
        return widgets.VBox([widgets.HBox([self.controls.box(), self.summary]), tabs])

    def _replan(self, _change=None) -> None:
        """Re-plan under the controls' settings; a QSyncError goes to the summary."""
        self.summary.value += "<div><i>re-planning…</i></div>"
        try:
            result = replan(self.study, self.controls.settings(), variants=self._variants)
        except QSyncError as err:
            self.summary.value = error_html(str(err), self.result)
            return
        self.result = result
        self.summary.value = summary_html(result)
        for name, widget in self._figure_widgets().items():
            if name in result.figures:
                replace_figure(widget, result.figures[name])

    def _export(self, _button=None) -> None:
        """Write the shown plan into the export folder and show the cluster's command."""
        try:
            path = export_plan(self.result.plan, self.root, self.export_folder.value)
        except QSyncError as err:
            self.export_status.value = error_html(str(err), None)
            return
        commands = "\n".join(cluster_commands(path, self.result.plan))
        self.export_status.value = (f"wrote <code>{html.escape(str(path))}</code>; on the "
                                    f"cluster:<pre>{html.escape(commands)}</pre>")

    def _start_run(self, _button=None) -> None:
        """Train the shown plan on this machine in the background, drawn live."""
        runs = self.root / RUNS_FOLDER
        runs.mkdir(parents=True, exist_ok=True)
        run_dir = tempfile.mkdtemp(prefix="run-", dir=runs)
        try:
            self.local_run = LocalRun(self.result.study, self.result.plan, run_dir,
                                      steps=self.steps.value)
        except QSyncError as err:
            self.run_status.value = error_html(str(err), None)
            return
        self.run_button.disabled, self.cancel_button.disabled = True, False
        self.run_status.value = f"started in <code>{html.escape(run_dir)}</code>"
        self.run_thread = self.local_run.follow(self._show_run)

    def _show_run(self, run: LocalRun) -> None:
        """Redraw the live figure; once the run has ended, its outcome."""
        replace_figure(self.live, plot_training(run.records,
                                                predicted_step_ms=run.predicted_step_ms))
        if run.process.poll() is None:
            last = run.records[-1]
            self.run_status.value = (f"step {last['step'] + 1} of {run.steps}: loss "
                                     f"{last['loss']:.4f}, slowest rank {max(last['step_ms']):.2f}"
                                     f" ms (predicted {run.predicted_step_ms:.2f} ms)")
            return
        self.run_status.value = html.escape(run.outcome())
        self.run_button.disabled, self.cancel_button.disabled = False, True

    def _cancel_run(self, _button=None) -> None:
        if self.local_run is not None:
            self.local_run.cancel()
