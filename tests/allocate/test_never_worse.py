"""Plans are never worse than fp32: properties over random instances and random models."""

import itertools
from types import MappingProxyType

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_lab.allocate import AdditiveInstance, Constraints, OpChoices, allocate_detailed
from qsync_lab.allocate.prune import prune_plans
from qsync_lab.allocate.recover import recover_instance
from qsync_lab.cluster import load_cluster
from qsync_lab.costs import CostModel
from qsync_lab.devices import load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision
from qsync_lab.simulate import PlanEvaluator, prepare_graph

from tests.allocate.conftest import mlp_graph, synthetic_indicator

FP32, FP16, INT8 = Precision.FP32, Precision.FP16, Precision.INT8


@st.composite
def instances(draw):
    """Additive instances where a low precision may cost time (casts around a small op)
    as well as save it, with a random time target and memory budget."""
    ops = draw(st.integers(2, 7))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    fp32_us = rng.uniform(10, 500, ops)
    weight_bytes = rng.uniform(1e5, 1e7, ops)
    risk, delta_us, delta_bytes = [], [], []
    for k in range(ops):
        fp16 = float(rng.uniform(0.01, 1.0))
        risk.append(MappingProxyType({INT8: fp16 * rng.uniform(2, 20), FP16: fp16, FP32: 0.0}))
        gain = rng.uniform(-0.3, 0.8)  # negative: the low precision is slower than fp32
        delta_us.append(MappingProxyType({INT8: -gain * 1.5 * fp32_us[k],
                                          FP16: -gain * fp32_us[k], FP32: 0.0}))
        delta_bytes.append(MappingProxyType({INT8: -0.5 * weight_bytes[k],
                                             FP16: -0.3 * weight_bytes[k], FP32: 0.0}))
    ladder = (INT8, FP16, FP32)
    choices = OpChoices(load_catalog().device("T4"), tuple(range(ops)), (ladder,) * ops,
                        tuple(risk))
    base_us, base_bytes = float(fp32_us.sum()), float(4 * weight_bytes.sum())
    fastest = base_us + sum(min(d.values()) for d in delta_us)
    target = fastest + draw(st.floats(0.0, 1.2)) * (base_us - fastest)
    budget = base_bytes * draw(st.sampled_from([0.7, 0.85, 1.0, 2.0]))
    return AdditiveInstance(choices, base_us, base_bytes, tuple(delta_us), tuple(delta_bytes),
                            target, budget)


@settings(max_examples=150, deadline=None)
@given(instances())
def test_no_subset_of_the_quantized_ops_is_as_fast_and_fits(inst):
    try:
        plan, stats = recover_instance(inst)
    except QSyncError:  # the budget is below the least memory: nothing to check
        return
    low = [k for k, p in plan.items() if p is not FP32]
    fp32_fits = inst.base_bytes <= inst.budget_bytes
    if fp32_fits and inst.base_us <= inst.target_us:
        assert not low, "all-fp32 meets the target and fits, yet ops were quantized"
    if fp32_fits:
        assert inst.time_us(plan) <= inst.base_us
    for size in range(1, len(low) + 1):  # exact: every plan with a subset of its quantized ops
        for raised in itertools.combinations(low, size):
            smaller = {**plan, **{k: FP32 for k in raised}}
            assert not (inst.time_us(smaller) <= inst.time_us(plan)
                        and inst.memory_bytes(smaller) <= inst.budget_bytes), (plan, raised)


@settings(max_examples=150, deadline=None)
@given(instances(), st.data())
def test_prune_gives_fp32_back_to_every_op_that_does_not_pay(inst, data):
    start = [data.draw(st.sampled_from(ladder)) for ladder in inst.choices.ladders]
    try:
        evaluator = inst.evaluator()
    except QSyncError:  # the budget is below the least memory
        return
    evaluator.plan = dict(enumerate(start))
    before_us = evaluator.iteration_us
    plan = list(start)
    raised = prune_plans(evaluator, {inst.KIND: inst.choices}, {inst.KIND: plan},
                         {inst.KIND: inst.budget_bytes})
    assert evaluator.plan == dict(enumerate(plan))
    assert raised == sum(a is not b for a, b in zip(start, plan))
    assert inst.time_us(evaluator.plan) <= before_us  # never slower than where it started
    all_fp32 = [FP32] * len(plan)
    if inst.base_bytes <= inst.budget_bytes and inst.base_us <= before_us:
        assert plan == all_fp32
    for k, p in enumerate(plan):
        if p is not FP32:  # it saves time, or memory the budget needs
            assert (inst.delta_us[k][p] < 0 or inst.memory_bytes(
                {**evaluator.plan, k: FP32}) > inst.budget_bytes), (k, p)


@settings(max_examples=12, deadline=None)
@given(widths=st.lists(st.sampled_from([64, 256, 1024, 2048]), min_size=3, max_size=6),
       tokens=st.sampled_from([1, 16, 128]), seed=st.integers(0, 1000),
       cluster=st.sampled_from(["v100-t4-small", "local-hybrid"]),
       memory_fraction=st.sampled_from([None, 0.9]))
def test_allocated_plans_pay_for_every_quantized_op_in_the_simulator(widths, tokens, seed,
                                                                     cluster, memory_fraction):
    torch.manual_seed(seed)
    graph = mlp_graph(widths, tokens)
    prepared, cl, costs = prepare_graph(graph), load_cluster(cluster), CostModel()
    evaluator = PlanEvaluator(prepared, cl, costs)
    fp32_us = evaluator.iteration_us
    budgets = {kind: float(cl.catalog.device(kind).memory_bytes) for kind in cl.device_kinds}
    if memory_fraction is not None:  # fp32 does not fit: every kind must save memory
        budgets = {kind: memory_fraction * evaluator.memory_bytes(kind, {}) for kind in budgets}
    constraints = Constraints(memory_gib={k: b / 2**30 for k, b in budgets.items()})
    try:
        result = allocate_detailed(prepared, cl, costs, synthetic_indicator(graph, seed),
                                   constraints)
    except QSyncError:  # no plan fits 90 % of fp32's memory
        assert memory_fraction is not None
        return
    if memory_fraction is None:
        assert result.iteration_us <= fp32_us * (1 + 1e-9)
    position = {name: i for i, name in enumerate(prepared.work.names)}
    for kind, ops in result.plan.precisions.items():
        evaluator.accept(evaluator.propose_plan(
            kind, {position[name]: p for name, p in ops.items()}))
    assert evaluator.iteration_us == pytest.approx(result.iteration_us, rel=1e-9)
    for kind, ops in result.plan.precisions.items():
        for name, p in ops.items():
            if p.forward is FP32:
                continue
            raised = evaluator.propose(kind, {position[name]: FP32})
            assert (raised.iteration_us > evaluator.iteration_us
                    or raised.tensor_peak_bytes > budgets[kind]), (kind, name, str(p))


def test_an_unreachable_target_says_the_best_reachable_time(small_case):
    prepared, cluster, costs, indicator = small_case
    with pytest.raises(QSyncError, match=r"best reachable [\d.]+ ms per iteration .* "
                                         r"target [\d.]+ ms"):
        allocate_detailed(prepared, cluster, costs, indicator,
                          Constraints(throughput_samples_per_s=1e9))
