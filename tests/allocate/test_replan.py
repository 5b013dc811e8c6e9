"""Re-planning under new constraints (a widget's slider) gives what a cold allocation gives:
the :class:`Allocator` and the evaluator's memo and timeline builders only skip work."""

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn

import qsync_lab
from qsync_lab.allocate import Allocation, Allocator, Constraints, allocate, allocate_detailed
from qsync_lab.cluster import load_cluster
from qsync_lab.costs import CostModel
from qsync_lab.devices import load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph
from qsync_lab.policy import check_op_precision, resolve_precisions
from qsync_lab.simulate import PlanEvaluator, prepare_graph, simulate
from qsync_lab.simulate.schedule import TimelineBuilder, compute_timeline

GIB = 2**30


class _ResidualNet(nn.Module):
    """Residual conv blocks (batch norm, ReLU), then a linear head: casts between
    candidates, ops that follow their inputs' precision, and branches."""

    def __init__(self, width: int = 32, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width),
                                  nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width))
            for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return self.head(x.mean(dim=(2, 3)))


@pytest.fixture(scope="module")
def residual_case():
    """(prepared graph, qsync-paper, costs, synthetic indicator of its convs and linear)."""
    torch.manual_seed(0)
    graph = trace_graph(_ResidualNet(), torch.randn(2, 3, 64, 64),
                        target=torch.tensor([1, 2]), loss_fn=nn.CrossEntropyLoss())
    ops = graph.ops.index[graph.ops["kind"].isin(["conv2d", "linear"])]
    rng = np.random.default_rng(0)
    fp16 = rng.uniform(0.1, 1.0, len(ops))
    scores = pd.DataFrame({("fp16", "risk"): fp16,
                           ("int8", "risk"): fp16 * rng.uniform(2, 10, len(ops))}, index=ops)
    return prepare_graph(graph), load_cluster("qsync-paper"), CostModel(), scores


def _slider(prepared, cluster, costs, scores) -> list[Constraints]:
    """Constraints as a user drags the throughput slider from the best reachable to the
    T4s' fp32 pace, past the best, back, then the T4 memory slider down past the least."""
    evaluator = PlanEvaluator(prepared, cluster, costs)
    best = allocate_detailed(prepared, cluster, costs, scores).target_us
    fastest, slowest = (cluster.global_batch_size * 1e6 / t
                        for t in (best, evaluator.pace_us("T4")))
    throughputs = [slowest + (fastest - slowest) * f for f in (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)]
    fp32_gib = evaluator.memory_bytes("T4", {}) / GIB
    fp16_gib = evaluator.memory_bytes("T4", {op: "fp16" for op in scores.index}) / GIB  # least
    budgets = [fp16_gib + (fp32_gib - fp16_gib) * f for f in (0.9, 0.6, 0.3, 0.05, -1.0)]
    return ([Constraints()]
            + [Constraints(throughput_samples_per_s=t)
               for t in [*throughputs, 1.5 * fastest, throughputs[2]]]
            + [Constraints(memory_gib={"T4": b}) for b in budgets]
            + [Constraints(memory_gib={"T4": budgets[1]}, throughput_samples_per_s=throughputs[1]),
               Constraints()])


def _outcome(allocate_one):
    """The plan an allocation returns (an :class:`Allocation`: all it reports but its run
    time), or its one-line error."""
    try:
        result = allocate_one()
    except QSyncError as err:
        return str(err)
    if isinstance(result, Allocation):
        return result.plan, result.iteration_us, result.target_us, result.stats, dict(result.risk)
    return result


def test_a_replan_equals_a_cold_allocation_along_a_slider(residual_case):
    prepared, cluster, costs, scores = residual_case
    allocator = Allocator(prepared, cluster, costs, scores)
    outcomes = []
    for constraints in _slider(prepared, cluster, costs, scores):
        cold = _outcome(lambda: allocate_detailed(prepared, cluster, costs, scores, constraints))
        assert _outcome(lambda: allocator.allocate(constraints)) == cold, constraints
        outcomes.append(cold)
    errors = [o for o in outcomes if isinstance(o, str)]
    assert any("no plan reaches the throughput target" in e for e in errors)
    assert any("T4 needs at least" in e for e in errors)
    plans = {o[0].to_json() for o in outcomes if not isinstance(o, str)}
    assert len(plans) >= 5  # the slider moves the plan


def test_the_study_keeps_its_allocator_and_replans_as_cold():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512), nn.ReLU(),
                          nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
    batch = (torch.randn(4, 64, 512), torch.randn(4, 64, 512))
    study = qsync_lab.Study(model, batch, cluster="v100-t4-small", loss_fn=nn.MSELoss(),
                            progress=False)
    kinds, pace = study.cluster.device_kinds, (
        study.cluster.global_batch_size * 1e6
        / PlanEvaluator(study.prepared, study.cluster, study.costs).pace_us("V100-SXM2-32GB"))
    for memory, throughput in ((None, None), (None, pace), (None, 0.8 * pace), (None, 3 * pace),
                               (0.01, None), (None, None)):
        constraints = Constraints(dict.fromkeys(kinds, memory) if memory else {}, throughput)
        cold = _outcome(lambda: allocate(study.prepared, study.cluster, study.costs,
                                         study.indicator(), constraints))
        assert _outcome(lambda: study.plan(memory_limit=memory,
                                           throughput_target=throughput)) == cold
    kept = study._allocator(None)
    assert study._allocator(None) is kept
    for options in ({}, {"strategy": "dynamic-batching"}, {"compression": "global_qsgd:8"}):
        plan = study.plan(**options)  # simulated from the allocator's memo, or fresh
        assert plan.strategy != "qsync" or plan.low_precision_ops()["T4"] > 0
        fresh = simulate(study.prepared, plan, study.cluster, study.costs)
        assert study.simulate(plan).events.equals(fresh.events)
    assert study._allocator(None) is not kept  # the compressed plan's allocator was kept
    for change in ("costs", "cluster"):  # new inputs: a new allocator, and plans from them
        kept = study._allocator(None)
        setattr(study, change, CostModel() if change == "costs" else load_cluster("qsync-paper"))
        assert study._allocator(None) is not kept
        assert study.plan() == allocate(study.prepared, study.cluster, study.costs,
                                        study.indicator())


def test_a_fork_shares_the_memo_and_leaves_the_original_as_it_was(residual_case):
    prepared, cluster, costs, scores = residual_case
    evaluator = PlanEvaluator(prepared, cluster, costs)
    before = evaluator.iteration_us
    twin = evaluator.fork()
    trial = twin.propose("T4", {op: "fp16" for op in range(len(prepared.work))
                                if prepared.work.names[op] in scores.index})
    twin.accept(trial)
    assert twin.iteration_us == trial.iteration_us != before
    assert evaluator.iteration_us == before and evaluator.plan("T4") == {}
    again = evaluator.propose("T4", dict(trial.plan))
    assert again.states[0] is trial.states[0]  # evaluated once, by the twin


def _random_assignments(work, device, count: int):
    """Assignments of random configs (explicit backward precisions among them) to the ops a
    plan may set on ``device``."""
    specs = ["fp32", "fp16", "bf16", "tf32", "int8", {"forward": "int8", "backward": "bf16"},
             {"forward": "fp16", "backward": "fp32"}]
    allowed = {}
    for i, kind in enumerate(work.kinds):
        for spec in specs:
            try:
                allowed.setdefault(i, []).append(check_op_precision(kind, spec, device))
            except QSyncError:
                continue
    rng = np.random.default_rng(1)
    for _ in range(count):
        plan = {i: configs[rng.integers(len(configs))] for i, configs in allowed.items()
                if configs and rng.random() < 0.7}
        yield resolve_precisions(work, plan, device)


def test_a_builder_reused_across_assignments_builds_each_timeline_as_a_fresh_one(
        residual_case):
    prepared, cluster, costs, _ = residual_case
    evaluator = PlanEvaluator(prepared, cluster, costs)
    work, a100 = prepared.work, load_catalog().device("A100-SXM4-80GB")
    builder = TimelineBuilder(work, costs, a100, batch_size=16, ddp=evaluator.ddp)
    for assignment in _random_assignments(work, a100, 12):
        fresh = compute_timeline(work, assignment, costs, a100, batch_size=16,
                                 ddp=evaluator.ddp)
        reused = builder.timeline(assignment)
        assert reused.events.to_frame(rank=0, stream="compute").equals(
            fresh.events.to_frame(rank=0, stream="compute"))
        assert reused.bucket_ready_us.tolist() == fresh.bucket_ready_us.tolist()
        assert reused.backward_end_us == fresh.backward_end_us


def test_a_proposed_change_evaluates_as_the_whole_plan_from_scratch(residual_case):
    prepared, cluster, costs, _ = residual_case
    work, kind = prepared.work, "T4"
    evaluator = PlanEvaluator(prepared, cluster, costs)
    configs = {i: [None, *(check_op_precision(work.kinds[i], spec, evaluator.devices[kind])
                           for spec in ("fp16", "int8", {"forward": "fp16", "backward": "fp32"}))]
               for i in range(len(work)) if work.kinds[i] in ("conv2d", "linear")}
    rng = np.random.default_rng(2)
    for step in range(40):
        ops = rng.choice(list(configs), size=rng.integers(1, 4), replace=False)
        trial = evaluator.propose(kind, {int(op): configs[op][rng.integers(4)] for op in ops})
        plan = {work.names[op]: config for op, config in trial.plan.items()}
        fresh = PlanEvaluator(prepared, cluster, costs, {kind: plan})
        state = fresh.states[cluster.device_kinds.index(kind)]
        assert trial.iteration_us == fresh.iteration_us, step
        assert trial.states[0].assignment == state.assignment
        assert trial.states[0].timeline.dur_us.tolist() == state.timeline.dur_us.tolist()
        assert trial.states[0].memory == state.memory
        if rng.random() < 0.5:
            evaluator.accept(trial)
