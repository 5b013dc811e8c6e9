import ipywidgets as widgets
import plotly.graph_objects as go
import pytest

import qsync_lab.widgets.tuner as tuner_module
from qsync_lab.errors import QSyncError
from qsync_lab.widgets import COMPARISON_TAB, FIGURES, PlanTuner

from .conftest import shown, simulated_bars, timeline_bars

V100 = "V100-SXM2-32GB"


def test_a_strategy_change_replans_once_and_redraws_in_place(tuner, study, monkeypatch):
    calls, replan = [], tuner_module.replan
    monkeypatch.setattr(tuner_module, "replan", lambda *a, **k: calls.append(a) or replan(*a, **k))
    widget = tuner.figures["timeline"]
    before = timeline_bars(widget)
    tuner.controls.strategy.value = "uniform-low"
    direct = study.plan(strategy="uniform-low")
    sim = study.simulate(direct)
    assert len(calls) == 1
    assert tuner.figures["timeline"] is widget and timeline_bars(widget) != before
    assert timeline_bars(widget) == simulated_bars(sim)
    assert tuner.result.plan == direct
    assert f"{sim.iteration_us / 1e3:.3f} ms" in tuner.summary.value
    assert "<td>T4</td><td>1 x 16</td>" in tuner.summary.value
    assert f"<td>{direct.low_precision_ops()['T4']}</td></tr>" in tuner.summary.value
    assert set(shown(tuner, "precision_map").data[0].colorbar.ticktext) > {"fp32"}


def test_the_memory_slider_is_the_studys_memory_limit(tuner, study):
    memory = shown(tuner, "memory")
    tuner.controls.memory_gib["T4"].value = 0.5
    direct = study.plan(memory_limit={V100: 32.0, "T4": 0.5})
    assert tuner.result.plan == direct
    assert list(memory.data[-1].y) == [32.0, 0.5]
    assert "/ 0.50 GiB" in tuner.summary.value
    assert timeline_bars(tuner.figures["timeline"]) == simulated_bars(study.simulate(direct))


def test_an_unreachable_target_shows_its_error_and_keeps_the_last_figures(tuner):
    tuner.controls.compression.value = "global_qsgd:8"
    figures = {n: shown(tuner, n).to_json() for n in FIGURES}
    last = tuner.result
    tuner.controls.throughput.value = tuner.controls.throughput.max
    assert "best reachable" in tuner.summary.value and "target" in tuner.summary.value
    assert "still showing the last feasible plan" in tuner.summary.value
    assert tuner.result is last
    assert {n: tuner.figures[n].to_json() for n in FIGURES} == figures
    tuner.controls.throughput.value = 0.0
    assert "best reachable" not in tuner.summary.value and tuner.result is not last


def test_a_baseline_below_the_target_says_so(tuner):
    tuner.controls.strategy.value = "uniform-low"
    tuner.controls.throughput.value = tuner.controls.throughput.max
    assert tuner.result.settings.strategy == "uniform-low"
    assert "below the throughput target" in tuner.summary.value


def test_composition_and_batch_controls_reshape_the_cluster(tuner):
    tuner.controls.counts["T4"].value = 2
    tuner.controls.batch_sizes["T4"].value = 32
    assert tuner.result.plan.batch_sizes == (16, 32, 32)
    assert "<td>T4</td><td>2 x 32</td>" in tuner.summary.value
    rows = {row for bars in tuner.figures["timeline"].data for row in bars.y}
    assert {row.split(") ")[0] + ")" for row in rows} == {"rank 0 (V100-SXM2-32GB)", "rank 1 (T4)"}


def test_a_kind_counted_out_leaves_its_budget_out(tuner):
    tuner.controls.memory_gib[V100].value = 20.0
    tuner.controls.counts[V100].value = 0
    assert tuner.result.sim.rank_devices == ("T4",)
    assert tuner.result.memory_gib == {"T4": 16.0}
    assert V100 not in tuner.summary.value and "<td>T4</td><td>1 x 16</td>" in tuner.summary.value


def test_the_panel_shows_in_a_notebook(tuner):
    assert isinstance(tuner.panel, widgets.VBox)
    bundle = tuner._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    tabs = tuner.panel.children[1]
    assert tabs is tuner.tabs
    assert tabs.titles == ("timeline", "memory", "indicator", "strategies", "precision map",
                           "export", "run locally")
    assert list(tuner.figures) == ["timeline"]
    assert tabs.children[0].children == (tuner.figures["timeline"],)
    precision_map, comparison = shown(tuner, "precision_map"), shown(tuner, "comparison")
    assert tabs.children[4].children == (precision_map,)
    assert comparison in tabs.children[COMPARISON_TAB].children


def test_a_figure_is_made_when_its_tab_is_first_shown_then_redrawn_by_each_change(tuner, study):
    tuner.controls.strategy.value = "uniform-low"
    assert "indicator" not in tuner.figures
    indicator = shown(tuner, "indicator")
    assert indicator.to_json() == go.FigureWidget(tuner.result.figures["indicator"]).to_json()
    tuner.controls.memory_gib["T4"].value = 0.5
    assert tuner.figures["indicator"] is indicator
    assert indicator.to_json() == go.FigureWidget(tuner.result.figures["indicator"]).to_json()


def test_the_comparison_is_drawn_when_shown_and_marked_stale_by_a_change(tuner, study,
                                                                          monkeypatch):
    calls, compare = [], study.compare
    monkeypatch.setattr(study, "compare", lambda **k: calls.append(k) or compare(**k))
    tuner.controls.memory_gib["T4"].value = 8.0
    assert not calls and "comparison" not in tuner.figures and tuner.compared is None
    tuner.tabs.selected_index = COMPARISON_TAB
    assert len(calls) == 1 and calls[0]["memory_limit"] == {V100: 32.0, "T4": 8.0}
    assert tuner.compared is tuner.result and tuner.compare_button.disabled
    comparison = tuner.figures["comparison"]
    assert list(comparison.data[0].x) == list(compare(memory_limit={"T4": 8.0}).index)
    assert "compared in" in tuner.comparison_status.value
    tuner.tabs.selected_index = 0
    tuner.tabs.selected_index = COMPARISON_TAB  # the same plan: not compared again
    tuner.controls.strategy.value = "uniform-low"
    assert len(calls) == 1 and "Compare strategies" in tuner.comparison_status.value
    assert not tuner.compare_button.disabled
    tuner.compare_button.click()
    assert len(calls) == 2 and tuner.compared is tuner.result


def test_a_failed_comparison_shows_its_error_above_an_empty_figure(tuner, study, monkeypatch):
    assert shown(tuner, "comparison").data

    def fails(**_):
        raise QSyncError("no batch split meets the constraints\nsecond line")

    monkeypatch.setattr(study, "compare", fails)
    tuner.controls.strategy.value = "fp32"
    tuner.compare_button.click()
    assert not tuner.figures["comparison"].data
    assert "no batch split meets the constraints" in tuner.comparison_status.value
    assert "second line" not in tuner.comparison_status.value


def test_a_tuner_needs_a_study_or_a_model(study):
    with pytest.raises(QSyncError, match="a Study, or model="):
        PlanTuner()
    with pytest.raises(QSyncError, match="a Study, or model="):
        PlanTuner(study, model="digits_cnn")
