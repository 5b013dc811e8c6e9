import numpy as np
import pytest

from qsync_lab.allocate.baselines import with_batch_sizes
from qsync_lab.simulate import PlanEvaluator, simulate


def _random_plan(prepared, scores, rng):
    choices = ["fp32", "fp16", "int8"]
    return {"T4": {op: choices[rng.integers(3)] for op in scores.index}}


@pytest.mark.parametrize("batches", [None, (40, 40, 24, 24), (40, 41, 24, 23)])
def test_incremental_evaluation_equals_simulate(small_case, batches):
    prepared, cluster, costs, scores = small_case
    if batches is not None:
        cluster = with_batch_sizes(cluster, batches)
    evaluator = PlanEvaluator(prepared, cluster, costs)
    rng = np.random.default_rng(0)
    index = {name: i for i, name in enumerate(prepared.work.names)}
    for _ in range(4):
        plan = _random_plan(prepared, scores, rng)
        proposal = evaluator.propose_plan("T4", {index[op]: p for op, p in plan["T4"].items()})
        evaluator.accept(proposal)
        sim = simulate(prepared, plan, cluster, costs)
        assert evaluator.iteration_us == pytest.approx(sim.iteration_us, rel=1e-12)
        t4 = [r.rank for r in cluster.ranks if r.device == "T4"]
        assert proposal.tensor_peak_bytes == pytest.approx(
            float(sim.tensor_peak_bytes.iloc[t4].max()), rel=1e-12)


def test_rejected_proposal_leaves_no_trace(small_case):
    prepared, cluster, costs, _ = small_case
    evaluator = PlanEvaluator(prepared, cluster, costs)
    before_us, before_plan = evaluator.iteration_us, dict(evaluator.plan("T4"))
    before_memory = evaluator.tensor_peak_bytes("T4")
    proposal = evaluator.propose("T4", {0: "int8"})
    assert proposal.iteration_us != before_us
    assert evaluator.iteration_us == before_us
    assert dict(evaluator.plan("T4")) == before_plan
    assert evaluator.tensor_peak_bytes("T4") == before_memory
    assert evaluator.propose("T4", {}).iteration_us == before_us


def test_pace_of_the_fast_kind_equals_the_all_fp32_iteration_when_it_is_the_slowest(small_case):
    prepared, cluster, costs, _ = small_case
    evaluator = PlanEvaluator(prepared, cluster, costs)
    assert evaluator.pace_us("T4") == pytest.approx(evaluator.iteration_us)
    assert evaluator.pace_us("V100-SXM2-32GB") < evaluator.iteration_us


def test_incremental_evaluation_equals_simulate_on_cpu_ranks(small_case):
    """local-hybrid emulated on the CPU: the allreduces delay the compute they share cores
    with, in the evaluator's replay as in the simulator."""
    from qsync_lab.cluster import load_cluster
    from qsync_lab.runtime.prediction import emulation_view

    prepared, _, costs, scores = small_case
    cluster, costs = emulation_view(load_cluster("local-hybrid"), costs)
    evaluator = PlanEvaluator(prepared, cluster, costs)
    index = {name: i for i, name in enumerate(prepared.work.names)}
    rng = np.random.default_rng(1)
    for _ in range(3):
        plan = _random_plan(prepared, scores, rng)
        evaluator.accept(evaluator.propose_plan(
            "T4", {index[op]: p for op, p in plan["T4"].items()}))
        sim = simulate(prepared, plan, cluster, costs)
        assert (sim.events["category"] == "ddp").any()
        assert evaluator.iteration_us == pytest.approx(sim.iteration_us, rel=1e-12)
