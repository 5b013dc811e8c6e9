"""``PlanTuner``: a notebook panel that re-plans a study as its controls change.

Each change of a control re-plans once (:func:`~qsync_lab.widgets.replan.replan`) and
redraws the summary and the figures in place; while it computes, the last result stays
shown, and a setting without a plan shows its one-line error above the last feasible plan,
whose figures stay. A figure's widget is made when its tab is first shown (its state
carries plotly.js, some 5 MB a widget), and redrawn by each change after. The strategy
comparison, which re-plans every strategy, is drawn when its tab is shown or its button
clicked, and marked stale by a change. The plan exports to a folder with the command for
the real cluster, and trains on this machine's emulated ranks with its loss and step time
drawn live.

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
    >>> list(tuner.figures), tuner.tabs.titles[COMPARISON_TAB]
    (['timeline'], 'strategies')
    >>> tuner.tabs.selected_index = COMPARISON_TAB  # draws the comparison
    >>> tuner.figures["comparison"].data[0].x[-1], tuner.compared is tuner.result
    ('joint', True)
"""

import html
import os
import tempfile
import threading
import time
from pathlib import Path

import ipywidgets as widgets
import plotly.graph_objects as go

from qsync_lab.errors import QSyncError
from qsync_lab.study import Study
from qsync_lab.viz import plot_training
from qsync_lab.widgets.controls import TunerControls
from qsync_lab.widgets.export import cluster_commands, export_plan, local_command
from qsync_lab.widgets.figures import replace_figure
from qsync_lab.widgets.local_run import LocalRun
from qsync_lab.widgets.replan import (FIGURES, TunerResult, TunerSettings, compare_result,
                                      replan)
from qsync_lab.widgets.summary import error_html, summary_html

__all__ = ["COMPARISON_TAB", "PlanTuner", "TABS"]

#: the throughput slider reaches this many times the first plan's throughput
THROUGHPUT_RANGE = 4.0
DEFAULT_STEPS = 30
RUNS_FOLDER = "tuner_runs"
#: the tabs, name -> title: the :data:`~qsync_lab.widgets.replan.FIGURES`, the comparison
#: fourth, then the export and the local run
TABS = {"timeline": "timeline", "memory": "memory", "indicator": "indicator",
        "comparison": "strategies", "precision_map": "precision map", "export": "export",
        "run": "run locally"}
COMPARISON_TAB = list(TABS).index("comparison")
_STALE = ("<i>not drawn for the shown plan: click <b>Compare strategies</b> (it re-plans "
          "every strategy)</i>")


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
        figures: the ``go.FigureWidget``\\ s made so far, by name: the
            :data:`~qsync_lab.widgets.replan.FIGURES` of each re-plan (the timeline's at
            once, each other's when its tab is first shown), ``comparison`` (with the first
            comparison) and ``live``, the local run's loss and step time (with the first run).
        compare_button, comparison_status: the strategy comparison's (``Button``, ``HTML``).
        result: the last feasible :class:`~qsync_lab.widgets.replan.TunerResult`.
        compared: the result the comparison was drawn for (None before the first).
        export_folder, export_button, export_status: the export (``Text``, ``Button``,
            ``HTML``).
        steps, run_button, cancel_button, run_status: the local run (``BoundedIntText``,
            two ``Button``\\ s, ``HTML``).
        local_run, run_thread: the last local run and the thread that follows it.
        tabs: the figures, export and local run (``Tab``; :data:`TABS`).
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
        self.result: TunerResult = replan(self.study, TunerSettings())
        self.controls = TunerControls.for_study(
            self.study, throughput_max=THROUGHPUT_RANGE * self.result.sim.throughput_samples_per_s)
        self.summary = widgets.HTML(summary_html(self.result),
                                    layout=widgets.Layout(flex="1 1 auto", min_width="0"))
        for control in self.controls.all():
            control.observe(self._replan, names="value")
        self.compare_button = widgets.Button(description="Compare strategies")
        self.comparison_status = widgets.HTML(_STALE)
        self.compared: TunerResult | None = None
        self.compare_button.on_click(self._compare)
        self.export_folder = widgets.Text("qsync_export", description="folder in root")
        self.export_button = widgets.Button(description="Export plan")
        self.export_status = widgets.HTML()
        self.export_button.on_click(self._export)
        self.steps = widgets.BoundedIntText(DEFAULT_STEPS, min=1, max=10**6, description="steps")
        self.run_button = widgets.Button(description="Run locally")
        self.cancel_button = widgets.Button(description="Cancel", disabled=True)
        self.run_status = widgets.HTML()
        self.run_button.on_click(self._start_run)
        self.cancel_button.on_click(self._cancel_run)
        self.local_run: LocalRun | None = None
        self.run_thread: threading.Thread | None = None
        self.figures: dict[str, go.FigureWidget] = {}
        self._pages = self._figure_pages()
        self.tabs = self._tabs()
        self.tabs.observe(self._tab_shown, names="selected_index")
        self._draw("timeline", self.result.figures["timeline"])
        self.panel = widgets.VBox([widgets.HBox([self.controls.box(), self.summary]), self.tabs])

    def display(self) -> None:
        """Show the panel in the notebook."""
        from IPython.display import display

        display(self.panel)

    def _repr_mimebundle_(self, **kwargs):
        return self.panel._repr_mimebundle_(**kwargs)

    def _figure_pages(self) -> dict[str, widgets.VBox]:
        """The box each figure's widget goes into, by figure name."""
        return {**{name: widgets.VBox() for name in FIGURES},
                "comparison": widgets.VBox([widgets.HBox([self.compare_button,
                                                          self.comparison_status])]),
                "live": widgets.VBox([widgets.HBox([self.steps, self.run_button,
                                                    self.cancel_button]), self.run_status])}

    def _tabs(self) -> widgets.Tab:
        pages = {**self._pages, "run": self._pages["live"], "export": widgets.VBox([
            widgets.HBox([self.export_folder, self.export_button]), self.export_status])}
        return widgets.Tab(children=[pages[name] for name in TABS], titles=list(TABS.values()))

    def _draw(self, name: str, figure: go.Figure) -> None:
        """Show ``figure`` in the widget of ``name``, made (below its page) on first use."""
        if name in self.figures:
            replace_figure(self.figures[name], figure)
        else:
            self.figures[name] = go.FigureWidget(figure)
            self._pages[name].children += (self.figures[name],)

    def _replan(self, _change=None) -> None:
        """Re-plan under the controls' settings; a QSyncError goes to the summary."""
        self.summary.value += "<div><i>re-planning…</i></div>"
        try:
            result = replan(self.study, self.controls.settings())
        except QSyncError as err:
            self.summary.value = error_html(str(err), self.result)
            return
        self.result = result
        self.summary.value = summary_html(result)
        for name in self.figures.keys() & result.figures.keys():
            self._draw(name, result.figures[name])
        self.comparison_status.value, self.compare_button.disabled = _STALE, False

    def _tab_shown(self, change) -> None:
        name = list(TABS)[change["new"]]
        if name == "comparison":
            self._compare()
        elif name in FIGURES and name not in self.figures:
            self._draw(name, self.result.figures[name])

    def _compare(self, _button=None) -> None:
        """Draw the strategies compared under the shown plan's settings (once per plan);
        a QSyncError goes to the comparison's status, above an empty figure."""
        result = self.result
        if self.compared is result:
            return
        self.comparison_status.value = "<i>comparing every strategy…</i>"
        start = time.perf_counter()
        try:
            figure = compare_result(result)
            status = (f"every strategy under the shown plan's settings (compared in "
                      f"{time.perf_counter() - start:.2f} s)")
        except QSyncError as err:
            figure, status = go.Figure(), error_html(str(err), None)
        self._draw("comparison", figure)
        self.compared, self.compare_button.disabled = result, True
        self.comparison_status.value = status

    def _export(self, _button=None) -> None:
        """Write the shown plan into the export folder and show the commands that train it:
        on the plan's cluster, and on this machine."""
        try:
            path = export_plan(self.result.plan, self.root, self.export_folder.value)
        except QSyncError as err:
            self.export_status.value = error_html(str(err), None)
            return
        commands = "\n".join(cluster_commands(path, self.result.plan))
        here = local_command(path, self.result.plan)
        self.export_status.value = (f"wrote <code>{html.escape(str(path))}</code>; on the "
                                    f"plan's cluster:<pre>{html.escape(commands)}</pre>on this "
                                    f"machine:<pre>{html.escape(here)}</pre>")

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
        self._draw("live", plot_training([]))
        self.run_thread = self.local_run.follow(self._show_run)

    def _show_run(self, run: LocalRun) -> None:
        """Redraw the live figure; once the run has ended, its outcome."""
        self._draw("live", plot_training(run.records, predicted_step_ms=run.predicted_step_ms))
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
