from qsync_lab.allocate import (STRATEGIES, allocate_detailed, compare_strategies,
                                dynamic_batching, joint_batch_precision, uniform_low_precision)
from qsync_lab.allocate.compare import plan_risk
from qsync_lab.precision import Precision


def test_dynamic_batching_keeps_the_global_batch_and_favours_the_fast_kind(small_case):
    prepared, cluster, costs, scores = small_case
    plan = dynamic_batching(prepared, cluster, costs, scores)
    assert sum(plan.batch_sizes) == cluster.global_batch_size
    v100, t4 = plan.batch_sizes[0], plan.batch_sizes[-1]
    assert v100 > 32 > t4
    assert plan.low_precision_ops() == {"V100-SXM2-32GB": 0, "T4": 0}


def test_uniform_low_precision_runs_every_candidate_narrowest(small_case):
    prepared, cluster, costs, scores = small_case
    plan = uniform_low_precision(prepared, cluster, costs, scores)
    assert {cfg.forward for cfg in plan.precisions["T4"].values()} == {Precision.INT8}
    assert set(plan.precisions["T4"]) == set(scores.index)


def test_joint_search_is_never_riskier_than_qsync(small_case):
    prepared, cluster, costs, scores = small_case
    joint = joint_batch_precision(prepared, cluster, costs, scores)
    qsync = allocate_detailed(prepared, cluster, costs, scores)
    assert plan_risk(joint, scores) <= sum(qsync.risk.values()) + 1e-12


def test_compare_strategies_table(small_case):
    prepared, cluster, costs, scores = small_case
    table = compare_strategies(prepared, cluster, costs, scores)
    assert table.index.tolist() == list(STRATEGIES)
    for column in ("throughput_samples_per_s", "iteration_ms", "low_precision_ops[T4]",
                   "indicator_sum", "tensor_peak_gib[T4]", "batch[T4]", "meets_target",
                   "allocation_s"):
        assert column in table.columns
    assert table.loc["qsync", "meets_target"]
    assert table.loc["qsync", "indicator_sum"] < table.loc["uniform-low", "indicator_sum"]
    assert (table.loc["qsync", "throughput_samples_per_s"]
            > table.loc["dynamic-batching", "throughput_samples_per_s"])


def test_compare_strategies_adds_a_row_per_compression(small_case):
    prepared, cluster, costs, scores = small_case
    table = compare_strategies(prepared, cluster, costs, scores,
                               strategies={"qsync": STRATEGIES["qsync"]},
                               compressions=["global_qsgd:8", "cgx:4,error_feedback=true"])
    assert table.index.tolist() == ["qsync", "qsync+global_qsgd:8",
                                    "qsync+cgx:4,error_feedback=true"]
    assert table["compression"].tolist() == ["none", "global_qsgd:8",
                                             "cgx:4,error_feedback=true"]
    # cheaper communication never makes the plan slower, and needs no more low precision
    assert (table.loc["qsync+global_qsgd:8", "iteration_ms"]
            <= table.loc["qsync", "iteration_ms"] * (1 + 1e-9))
    assert (table.loc["qsync+global_qsgd:8", "low_precision_ops[T4]"]
            <= table.loc["qsync", "low_precision_ops[T4]"])
