import re

import pandas as pd
import pytest

from qsync_lab.allocate import (Constraints, allocate, allocate_detailed,
                                uniform_low_precision)
from qsync_lab.allocate.recover import greedy_recover
from qsync_lab.allocate.choices import OpChoices
from qsync_lab.devices import load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision
from qsync_lab.simulate import PlanEvaluator, simulate

GIB = 2**30


def _check(plan, prepared, cluster, costs, *, target_us, budget_gib):
    sim = simulate(prepared, plan, cluster, costs)
    assert sim.iteration_us <= target_us * (1 + 1e-9)
    t4 = [r.rank for r in cluster.ranks if r.device == "T4"]
    assert sim.tensor_peak_bytes.iloc[t4].max() <= budget_gib * GIB
    return sim


@pytest.mark.parametrize("pace_fraction", [1.0, 0.95, 0.8])
@pytest.mark.parametrize("memory_slack", [0.0, 0.002, 1.0])
def test_greedy_never_violates_memory_or_throughput(small_case, pace_fraction, memory_slack):
    prepared, cluster, costs, scores = small_case
    pace_us = PlanEvaluator(prepared, cluster, costs).pace_us("V100-SXM2-32GB")
    throughput = pace_fraction * cluster.global_batch_size * 1e6 / pace_us
    t4 = PlanEvaluator(prepared, cluster, costs)
    fp32_gib = t4.memory_bytes("T4", {}) / GIB
    budget_gib = fp32_gib * (1 + memory_slack)
    constraints = Constraints(memory_gib={"T4": budget_gib}, throughput_samples_per_s=throughput)
    result = allocate_detailed(prepared, cluster, costs, scores, constraints)
    _check(result.plan, prepared, cluster, costs, target_us=result.target_us,
           budget_gib=budget_gib)
    assert result.target_us == pytest.approx(cluster.global_batch_size * 1e6 / throughput)
    assert result.stats.accepted <= result.stats.trials


def test_default_pace_is_the_fast_kind_at_fp32(small_case):
    prepared, cluster, costs, scores = small_case
    result = allocate_detailed(prepared, cluster, costs, scores)
    pace_us = PlanEvaluator(prepared, cluster, costs).pace_us("V100-SXM2-32GB")
    assert result.target_us == pytest.approx(pace_us)
    sim = _check(result.plan, prepared, cluster, costs, target_us=pace_us, budget_gib=16)
    assert result.iteration_us == pytest.approx(sim.iteration_us)
    assert result.plan.precisions["V100-SXM2-32GB"] == {}
    assert 0 < result.plan.low_precision_ops()["T4"] < len(scores)


def test_loose_constraints_give_all_fp32(small_case):
    prepared, cluster, costs, scores = small_case
    plan = allocate(prepared, cluster, costs, scores, Constraints(throughput_samples_per_s=1.0))
    assert plan.low_precision_ops() == {"V100-SXM2-32GB": 0, "T4": 0}


def test_memory_budget_below_the_minimum_states_the_minimum(small_case):
    prepared, cluster, costs, scores = small_case
    with pytest.raises(QSyncError, match=r"T4 needs at least [\d.]+ GiB .* budget is 0.1 GiB") \
            as err:
        allocate(prepared, cluster, costs, scores, Constraints(memory_gib={"T4": 0.1}))
    assert "\n" not in str(err.value)
    least_gib = float(re.search(r"at least ([\d.]+) GiB", str(err.value)).group(1))
    plan = allocate(prepared, cluster, costs, scores,
                    Constraints(memory_gib={"T4": least_gib + 0.01},
                                throughput_samples_per_s=1.0))
    _check(plan, prepared, cluster, costs, target_us=float("inf"), budget_gib=least_gib + 0.01)


def test_memory_alone_makes_a_fast_enough_kind_quantize(small_case):
    prepared, cluster, costs, scores = small_case
    evaluator = PlanEvaluator(prepared, cluster, costs)
    fp32_gib = evaluator.memory_bytes("T4", {}) / GIB
    # all-fp16 holds least: its linears write fp16 that the ReLUs keep and the next linear
    # shares (int8 linears write fp32, which the ReLUs keep, plus their int8 copies)
    fp16_gib = evaluator.memory_bytes("T4", {op: "fp16" for op in scores.index}) / GIB
    assert fp16_gib < fp32_gib
    budget_gib = (fp32_gib + fp16_gib) / 2  # below fp32, above all-fp16
    plan = allocate(prepared, cluster, costs, scores,
                    Constraints(memory_gib={"T4": budget_gib}, throughput_samples_per_s=1.0))
    assert plan.low_precision_ops()["T4"] > 0
    _check(plan, prepared, cluster, costs, target_us=float("inf"), budget_gib=budget_gib)


def test_a_budget_only_the_first_int8_linear_meets_is_met(small_case):
    """With int8 the only low precision, the plan holding least quantizes the first linear
    alone: its int8 copy replaces the fp32 input it keeps, while a later int8 linear keeps
    an int8 copy of the fp32 output the ReLU before it keeps anyway. Judged by ``bits /
    32`` of what each op saves, every int8 linear saved memory, and the allocator stated
    the all-int8 plan's memory as the least."""
    prepared, cluster, costs, scores = small_case
    int8_only = pd.DataFrame({("int8", "risk"): scores[("int8", "risk")]})
    evaluator = PlanEvaluator(prepared, cluster, costs)
    ops = [prepared.work.index_of(name) for name in scores.index]
    least = evaluator.memory_bytes("T4", {ops[0]: "int8"})
    fp32 = evaluator.memory_bytes("T4", {})
    assert least < fp32 < evaluator.memory_bytes("T4", dict.fromkeys(ops, "int8"))
    budget_gib = (least + fp32) / 2 / GIB
    plan = allocate(prepared, cluster, costs, int8_only,
                    Constraints(memory_gib={"T4": budget_gib}, throughput_samples_per_s=1.0))
    assert str(plan.precisions["T4"][scores.index[0]].forward) == "int8"
    _check(plan, prepared, cluster, costs, target_us=float("inf"), budget_gib=budget_gib)


def test_unreachable_explicit_throughput_is_a_one_line_error(small_case):
    prepared, cluster, costs, scores = small_case
    with pytest.raises(QSyncError, match="no plan reaches the throughput target"):
        allocate(prepared, cluster, costs, scores, Constraints(throughput_samples_per_s=1e9))


def test_qsync_quantizes_fewer_ops_than_uniform_low_precision(small_case):
    prepared, cluster, costs, scores = small_case
    qsync = allocate(prepared, cluster, costs, scores)
    uniform = uniform_low_precision(prepared, cluster, costs, scores)
    assert qsync.low_precision_ops()["T4"] < uniform.low_precision_ops()["T4"] == len(scores)


class _Toy:
    """Additive evaluator: time = sum of per-op times; records the order of trials."""

    def __init__(self, times):
        self.times, self.plan, self.tried = times, {0: Precision.FP16, 1: Precision.FP16}, []

    def propose(self, kind, changes):
        plan = {**self.plan, **changes}
        self.tried.append(next(iter(changes)))
        return type("P", (), {"plan": plan, "tensor_peak_bytes": 0.0,
                              "iteration_us": sum(self.times[o][p] for o, p in plan.items())})

    def accept(self, proposal):
        self.plan = proposal.plan


def test_heap_pops_the_largest_reduction_per_microsecond_first():
    fp16, fp32 = Precision.FP16, Precision.FP32
    ladder = (fp16, fp32)
    # op 0: gain 1 for 10 us (0.1/us); op 1: gain 3 for 10 us (0.3/us): op 1 goes first,
    # and the budget (+10 us) admits only one of them
    choices = OpChoices(load_catalog().device("T4"), (0, 1), (ladder, ladder),
                        ({fp16: 1.0, fp32: 0.0}, {fp16: 3.0, fp32: 0.0}))
    times = {0: {fp16: 10.0, fp32: 20.0}, 1: {fp16: 10.0, fp32: 20.0}}
    toy = _Toy(times)
    plans = {"T4": [fp16, fp16]}
    greedy_recover(toy, {"T4": choices}, plans,
                   lambda _, k, plan, p: times[k][p] - times[k][plan[k]],
                   target_us=30.0, budgets_bytes={"T4": 1.0})
    assert toy.tried[0] == 1
    assert plans["T4"] == [fp16, fp32]


def test_two_kinds_allocated_together_stay_within_their_limits(small_case):
    prepared, cluster, costs, scores = small_case
    evaluator = PlanEvaluator(prepared, cluster, costs)
    budgets = {kind: 0.97 * evaluator.memory_bytes(kind, {}) / GIB for kind in cluster.device_kinds}
    result = allocate_detailed(prepared, cluster, costs, scores,
                               Constraints(memory_gib=budgets))
    sim = simulate(prepared, result.plan, cluster, costs)
    assert sim.iteration_us <= result.target_us * (1 + 1e-9)
    assert sim.iteration_us == pytest.approx(result.iteration_us)
    for kind, budget in budgets.items():
        ranks = [r.rank for r in cluster.ranks if r.device == kind]
        assert sim.tensor_peak_bytes.iloc[ranks].max() <= budget * GIB
        assert result.plan.low_precision_ops()[kind] > 0
