import itertools
import statistics

import pytest

from qsync_lab.allocate import (AdditiveInstance, PlanEvaluator, exact_plan, linearized_instance,
                                op_choices, optimality_gap)
from qsync_lab.allocate.recover import greedy_recover_instance
from qsync_lab.cluster import load_cluster
from qsync_lab.costs import CostModel
from qsync_lab.simulate import prepare_graph


def test_exact_plan_is_the_brute_force_optimum():
    inst = AdditiveInstance.random(ops=6, seed=3)
    best = min((dict(enumerate(plan)) for plan in itertools.product(*inst.choices.ladders)
                if inst.time_us(dict(enumerate(plan))) <= inst.target_us
                and inst.memory_bytes(dict(enumerate(plan))) <= inst.budget_bytes),
               key=inst.risk)
    assert inst.risk(exact_plan(inst)) == pytest.approx(inst.risk(best))


def test_greedy_meets_the_instance_limits():
    for seed in range(10):
        inst = AdditiveInstance.random(ops=10, seed=seed, slack=0.3)
        plan, _ = greedy_recover_instance(inst)
        assert inst.time_us(plan) <= inst.target_us * (1 + 1e-9)
        assert inst.memory_bytes(plan) <= inst.budget_bytes


def test_greedy_is_close_to_the_exact_optimum_on_small_instances(make_mlp):
    gaps = [optimality_gap(AdditiveInstance.random(ops=10, seed=seed)) for seed in range(20)]
    cluster, costs = load_cluster("v100-t4-small"), CostModel()
    for seed, widths in enumerate([[1024, 4096, 2048, 4096, 1024, 2048, 1024],
                                   [2048, 1024, 3072, 1024, 4096, 1024, 2048, 1024, 1024]]):
        graph, scores = make_mlp(widths, seed)
        evaluator = PlanEvaluator(prepare_graph(graph), cluster, costs)
        choices = op_choices(evaluator.prepared.work, scores, evaluator.devices["T4"])
        gaps.append(optimality_gap(linearized_instance(evaluator, "T4", choices,
                                                       budget_bytes=16 * 2**30)))
    for i, gap in enumerate(gaps):
        print(f"instance {i:2d}: greedy {gap.greedy_risk:.4g}, exact {gap.exact_risk:.4g}, "
              f"gap {gap.gap:.2%}")
        assert gap.exact_risk <= gap.greedy_risk + 1e-9
    mean_gap = statistics.mean(g.gap for g in gaps)
    print(f"mean gap {mean_gap:.2%}, worst {max(g.gap for g in gaps):.2%}")
    assert mean_gap <= 0.05
