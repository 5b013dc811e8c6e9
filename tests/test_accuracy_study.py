"""The accuracy study: paired tests and tables (qsync_lab.accuracy) and the study's
pipeline end to end (benchmarks/accuracy_study.py, a tiny configuration)."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from qsync_lab.accuracy import PairedTest, paired_test, paired_tests, summary_table
from qsync_lab.errors import QSyncError

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _runs(accuracy: dict[str, list[float]], throughput: dict[str, float]) -> pd.DataFrame:
    return pd.DataFrame([{"task": "t", "strategy": s, "seed": seed, "test_accuracy": a,
                          "speed": throughput[s]}
                         for s, values in accuracy.items() for seed, a in enumerate(values)])


def test_paired_test_is_scipys_paired_t_test():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0.9, 0.01, 5), rng.normal(0.89, 0.01, 5)
    test = paired_test(a, b)
    expected = stats.ttest_rel(a, b)
    assert test.n == 5
    assert test.mean_difference == pytest.approx(float(np.mean(a - b)))
    assert test.statistic == pytest.approx(expected.statistic)
    assert test.p_value == pytest.approx(expected.pvalue)


def test_identical_pairs_test_as_no_difference():
    assert paired_test([0.5, 0.7], [0.5, 0.7]) == PairedTest(2, 0.0, 0.0, 1.0)


@pytest.mark.parametrize("a, b, message", [
    ([0.9, 0.8], [0.9], "equal-length series of at least 2 values"),
    ([0.9], [0.8], "at least 2 values"),
    ([0.9, float("nan")], [0.8, 0.7], "NaN or Inf"),
])
def test_paired_test_errors(a, b, message):
    with pytest.raises(QSyncError, match=message):
        paired_test(a, b)


@pytest.mark.parametrize("p_value, higher_is_better, verdict", [
    (0.2, True, "within noise"), (0.01, True, "better"), (0.01, False, "worse")])
def test_verdict(p_value, higher_is_better, verdict):
    assert PairedTest(3, 0.02, 5.0, p_value).verdict(higher_is_better=higher_is_better) == verdict


def test_summary_table_has_a_row_per_strategy_in_run_order_rounded():
    runs = _runs({"qsync": [0.91234, 0.92345, 0.93456], "fp32": [0.9, 0.95, 0.97]},
                 {"qsync": 10.0, "fp32": 9.0})
    table = summary_table(runs, "test_accuracy", plan_columns=["speed"], decimals=2)
    assert list(table.index) == [("t", "qsync"), ("t", "fp32")]
    assert list(table.columns) == ["n", "mean", "std", "speed"]
    assert table.loc[("t", "qsync"), "mean"] == 0.92
    assert table.loc[("t", "fp32"), "std"] == round(float(np.std([0.9, 0.95, 0.97], ddof=1)), 2)
    assert table.loc[("t", "fp32"), "speed"] == 9.0


def test_summary_table_refuses_a_plan_column_that_varies_over_seeds():
    runs = _runs({"qsync": [0.9, 0.8]}, {"qsync": 1.0})
    runs.loc[1, "speed"] = 2.0
    with pytest.raises(QSyncError, match="column 'speed' differs between the seeds"):
        summary_table(runs, "test_accuracy", plan_columns=["speed"])


def test_paired_tests_check_the_claim_on_mean_and_throughput():
    runs = _runs({"qsync": [0.90, 0.92, 0.91], "int8": [0.89, 0.90, 0.90],
                  "fp16": [0.89, 0.90, 0.90], "better": [0.95, 0.96, 0.97]},
                 {"qsync": 98.0, "int8": 98.5, "fp16": 100.0, "better": 90.0})
    tests = paired_tests(runs, "test_accuracy", reference="qsync",
                         against=["int8", "fp16", "better"], throughput="speed")
    assert tests.loc[("t", "int8"), "claim_holds"]  # 98 >= 0.99 * 98.5
    assert not tests.loc[("t", "fp16"), "claim_holds"]  # 98 < 0.99 * 100
    assert not tests.loc[("t", "better"), "claim_holds"]  # its accuracy is higher
    assert tests.loc[("t", "int8"), "p_value"] == pytest.approx(
        stats.ttest_rel([0.90, 0.92, 0.91], [0.89, 0.90, 0.90]).pvalue)
    assert tests.loc[("t", "better"), "verdict"] == "worse"
    lower_is_better = paired_tests(runs, "test_accuracy", reference="qsync",
                                   against=["better"], throughput="speed",
                                   higher_is_better=False)
    assert lower_is_better.loc[("t", "better"), "verdict"] == "better"


def test_paired_tests_need_every_seed_of_both_strategies():
    runs = _runs({"qsync": [0.9, 0.8, 0.7], "int8": [0.9, 0.8, 0.7]}, {"qsync": 1, "int8": 1})
    with pytest.raises(QSyncError, match="'qsync' and 'fp16' need a run for every seed"):
        paired_tests(runs, "test_accuracy", reference="qsync", against=["fp16"],
                     throughput="speed")
    with pytest.raises(QSyncError, match="need a run for every seed"):
        paired_tests(runs.drop(index=5), "test_accuracy", reference="qsync", against=["int8"],
                     throughput="speed")


@pytest.fixture
def study(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import accuracy_study

    return accuracy_study


def test_identical_local_plans_share_one_run_per_seed(study, tmp_path):
    from qsync_lab.cluster import load_cluster
    from qsync_lab.graph import trace_graph
    from qsync_lab.models import example_batch, get_model
    from qsync_lab.plan import Plan

    graph = trace_graph(get_model("digits_mlp"), example_batch("digits_mlp", 2)[0])
    cluster = load_cluster("local-hybrid")

    def plan(strategy, t4):
        return Plan.build(graph, cluster, {"T4": t4}, strategy=strategy)

    plans = {"t": {"fp32": plan("fp32", {}), "qsync": plan("qsync", {"fc1": "fp32"}),
                   "int8": plan("int8", {"fc1": "int8"})}}
    runs = study.schedule_runs(plans, [0, 1], tmp_path)
    assert [(r.strategy, r.seed, r.same_run_as) for r in runs] == [
        ("fp32", 0, ""), ("fp32", 1, ""), ("qsync", 0, "fp32"), ("qsync", 1, "fp32"),
        ("int8", 0, ""), ("int8", 1, "")]
    assert runs[2].run_dir == runs[0].run_dir and runs[4].run_dir != runs[0].run_dir
    assert Plan.load(runs[4].plan_path) == plans["t"]["int8"]


def test_the_study_runs_end_to_end(study, tmp_path):
    frame = study.main(["--tasks", "digits_mlp", "--strategies", "fp32,uniform-int8",
                        "--seeds", "1", "--steps", "4", "--out-dir", str(tmp_path)])
    csv = pd.read_csv(tmp_path / study.CSV_NAME, keep_default_na=False)
    assert csv["strategy"].tolist() == ["fp32", "uniform-int8"] == frame["strategy"].tolist()
    assert csv["steps"].tolist() == [4, 4]
    assert csv["t4_int8_ops"].tolist()[0] == 0 < csv["t4_int8_ops"].tolist()[1]
    assert ((csv["test_accuracy"] >= 0) & (csv["test_accuracy"] <= 1)).all()
    assert (csv["paper_throughput_samples_per_s"] > 0).all()
    assert csv["local_batches"].tolist() == ["32/32", "32/32"]
    report = (tmp_path / study.REPORT_NAME).read_text()
    assert "digits_mlp" in report and "uniform-int8" in report
    assert "paired t-tests" not in report  # one seed: nothing to pair
