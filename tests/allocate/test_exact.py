import dataclasses
import itertools
import statistics

import numpy as np
import pytest

from qsync_lab.allocate import (AdditiveInstance, exact_plan, linearized_instance,
                                op_choices, optimality_gap)
from qsync_lab.allocate.recover import recover_instance, recover_plans
from qsync_lab.cluster import load_cluster
from qsync_lab.costs import CostModel
from qsync_lab.precision import Precision
from qsync_lab.simulate import PlanEvaluator, prepare_graph


def test_exact_plan_is_the_brute_force_optimum():
    inst = AdditiveInstance.random(ops=6, seed=3)
    best = min((dict(enumerate(plan)) for plan in itertools.product(*inst.choices.ladders)
                if inst.time_us(dict(enumerate(plan))) <= inst.target_us
                and inst.memory_bytes(dict(enumerate(plan))) <= inst.budget_bytes),
               key=inst.risk)
    assert inst.risk(exact_plan(inst)) == pytest.approx(inst.risk(best))


def test_recovery_meets_the_instance_limits():
    for seed in range(10):
        inst = AdditiveInstance.random(ops=10, seed=seed, slack=0.3)
        plan, _ = recover_instance(inst)
        assert inst.time_us(plan) <= inst.target_us * (1 + 1e-9)
        assert inst.memory_bytes(plan) <= inst.budget_bytes


def test_recovery_meets_the_limits_and_stays_close_when_the_estimates_are_off():
    gaps = []
    for seed in range(30):
        inst = AdditiveInstance.random(ops=10 + seed % 5, seed=seed)
        chain = inst.chain()
        noise = np.random.default_rng(seed).normal(0.0, 0.1, chain.node_us.shape)
        plans = {inst.KIND: list(inst.fastest_plan())}
        recover_plans(inst.evaluator(), {inst.KIND: inst.choices},
                      {inst.KIND: dataclasses.replace(chain, node_us=chain.node_us * (1 + noise))},
                      plans, target_us=inst.target_us, budgets_bytes={inst.KIND: inst.budget_bytes})
        plan = dict(enumerate(plans[inst.KIND]))
        assert inst.time_us(plan) <= inst.target_us * (1 + 1e-9)
        assert inst.memory_bytes(plan) <= inst.budget_bytes
        gaps.append(inst.risk(plan) / inst.risk(exact_plan(inst)) - 1)
    print(f"estimates 10 % off: mean gap {statistics.mean(gaps):.2%}, worst {max(gaps):.2%}")
    assert statistics.mean(gaps) <= 0.02


def test_recovery_finds_the_optimum_under_a_memory_budget():
    for seed in range(10):
        inst = AdditiveInstance.random(ops=10, seed=seed)
        least = inst.memory_bytes({k: Precision.INT8 for k in range(10)})
        inst = dataclasses.replace(inst, target_us=inst.base_us,
                                   budget_bytes=(least + inst.base_bytes) / 2)
        gap = optimality_gap(inst)
        assert inst.memory_bytes(recover_instance(inst)[0]) <= inst.budget_bytes
        assert gap.gap <= 0.05, (seed, gap)


def test_recovery_is_within_5_percent_of_the_exact_optimum_on_small_instances(make_mlp):
    gaps = [optimality_gap(AdditiveInstance.random(ops=10 + seed % 5, seed=seed))
            for seed in range(40)]
    cluster, costs = load_cluster("v100-t4-small"), CostModel()
    for seed, widths in enumerate([[1024, 4096, 2048, 4096, 1024, 2048, 1024],
                                   [2048, 1024, 3072, 1024, 4096, 1024, 2048, 1024, 1024]]):
        graph, scores = make_mlp(widths, seed)
        evaluator = PlanEvaluator(prepare_graph(graph), cluster, costs)
        choices = op_choices(evaluator.prepared.work, scores, evaluator.devices["T4"])
        gaps.append(optimality_gap(linearized_instance(evaluator, "T4", choices,
                                                       budget_bytes=16 * 2**30)))
    for i, gap in enumerate(gaps):
        print(f"instance {i:2d}: recovered {gap.recovered_risk:.4g}, exact {gap.exact_risk:.4g}, "
              f"gap {gap.gap:.2%}")
        assert gap.exact_risk <= gap.recovered_risk + 1e-9
    worst = max(g.gap for g in gaps)
    print(f"mean gap {statistics.mean(g.gap for g in gaps):.2%}, worst {worst:.2%} "
          f"over {len(gaps)} instances")
    assert worst <= 0.05
