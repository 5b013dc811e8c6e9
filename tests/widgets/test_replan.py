import math

import pytest

from qsync_lab.errors import QSyncError
from qsync_lab.widgets import FIGURES, TunerSettings, compare_result, replan, summary_html

from .conftest import simulated_bars, timeline_bars

V100 = "V100-SXM2-32GB"


def test_a_replan_is_the_studys_plan_and_simulation_drawn(study):
    settings = TunerSettings(memory_gib={V100: 30.0, "T4": 8.0}, strategy="uniform-low",
                             compression="global_qsgd:8")
    result = replan(study, settings)
    direct = study.plan(memory_limit={V100: 30.0, "T4": 8.0}, strategy="uniform-low",
                        compression="global_qsgd:8")
    sim = study.simulate(direct)
    assert result.plan == direct and result.plan.low_precision_ops()["T4"] > 0
    assert result.sim.iteration_us == pytest.approx(sim.iteration_us)
    assert timeline_bars(result.figures["timeline"]) == simulated_bars(sim)
    assert list(result.figures["memory"].data[-1].y) == [30.0, 8.0]
    assert f"{sim.iteration_us / 1e3:.3f} ms" in summary_html(result)
    assert set(result.figures) == set(FIGURES)


def test_the_indicator_draws_the_ops_scored_at_the_lowest_precision(study):
    figure = replan(study, TunerSettings()).figures["indicator"]
    scores = study.indicator()["int8", "risk"]
    assert set(figure.data[0].x) == set(scores.dropna().index) != set(scores.index)
    assert all(math.isfinite(y) for bars in figure.data for y in bars.y)


def test_the_comparison_is_drawn_apart_under_the_same_constraints(study, monkeypatch):
    calls, compare = [], study.compare
    monkeypatch.setattr(study, "compare", lambda **k: calls.append(k) or compare(**k))
    result = replan(study, TunerSettings(memory_gib={V100: 30.0}, compression="global_qsgd:8"))
    assert not calls
    figure = compare_result(result)
    assert calls == [{"memory_limit": {V100: 30.0}, "throughput_target": None,
                      "compressions": ["global_qsgd:8"]}]
    assert "qsync+global_qsgd:8" in figure.data[0].x


def test_an_unreachable_target_says_the_best_reachable(study):
    fastest = replan(study, TunerSettings()).sim.throughput_samples_per_s
    with pytest.raises(QSyncError, match=r"best reachable [\d.]+ ms .*target [\d.]+ ms"):
        replan(study, TunerSettings(throughput_samples_per_s=10 * fastest))


def test_a_composition_is_made_once_and_shares_the_traced_graph(study):
    first = replan(study, TunerSettings(counts={"T4": 2}))
    again = replan(study, TunerSettings(counts={"T4": 2}, strategy="fp32"))
    assert again.study is first.study is not study
    assert first.study.graph is study.graph and study.cluster.world_size == 2
    assert first.sim.rank_devices == (V100, "T4", "T4")
    assert replan(study, TunerSettings(counts={"T4": 1})).study is study


def test_a_failed_comparison_raises_its_error(study, monkeypatch):
    def fails(**_):
        raise QSyncError("no batch split meets the constraints\nsecond line")

    monkeypatch.setattr(study, "compare", fails)
    with pytest.raises(QSyncError, match="no batch split"):
        compare_result(replan(study, TunerSettings()))
