"""``allocate``: QSync's quantization-minimized plan under memory and throughput constraints.

1. The pace: the least throughput allowed (default: the iteration time of the cluster if
   every rank computed like the fastest device kind at full precision).
2. The kinds that cannot keep up: those whose fp32 pace is slower than the target, or
   whose fp32 plan does not fit their memory budget. Other kinds stay fp32.
3. Each such kind starts from its fastest plan that fits memory
   (:func:`~qsync_lab.allocate.fastest_feasible_plan`). If the cluster is still slower
   than the target: with the default pace, the target becomes that plan's iteration time
   (QSync's ``C0 = max(T_slow, T_fast_fp32)``: the slow kinds run as fast as they can and
   recover only what costs no time); with an explicit throughput, no plan meets it and
   the error says by how much.
4. The recovery (:func:`~qsync_lab.allocate.recover_plans`) raises ops to higher
   precision, accepting a plan only while the predicted iteration time meets the target
   and memory fits; every trial re-simulates only the changed kind
   (:class:`~qsync_lab.simulate.PlanEvaluator`). It bisects the least-risk frontiers of
   the chain estimates (a knapsack over time, one over memory) for their best plan that
   the simulator accepts, then runs QSync's greedy (largest indicator reduction per added
   microsecond first) from it and from the start, and keeps the plan of less risk
   (``benchmarks/allocator.py`` measures its gap to the exact optimum of
   :mod:`~qsync_lab.allocate.exact`).

Example::

    >>> import pandas as pd
    >>> import torch, torch.nn as nn
    >>> from qsync_lab.cluster import load_cluster
    >>> from qsync_lab.costs import CostModel
    >>> from qsync_lab.graph import trace_graph
    >>> model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    >>> graph = trace_graph(model, torch.randn(4, 64, 1024))
    >>> scores = pd.DataFrame({("fp16", "risk"): [1.0, 2.0], ("int8", "risk"): [4.0, 8.0]},
    ...                       index=["0", "2"])
    >>> plan = allocate(graph, load_cluster("v100-t4-small"), CostModel(), scores)
    >>> plan.strategy, plan.precisions["V100-SXM2-32GB"] == {}
    ('qsync', True)

Re-planning one model under other constraints (a slider) keeps an :class:`Allocator`::

    >>> allocator = Allocator(graph, load_cluster("v100-t4-small"), CostModel(), scores)
    >>> fast = allocator.allocate(Constraints(throughput_samples_per_s=2000.0))
    >>> allocator.allocate().plan == plan
    True
"""

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import pandas as pd

from qsync_lab.allocate.chain import ChainCosts, chain_costs
from qsync_lab.allocate.choices import OpChoices, op_choices
from qsync_lab.constraints import Constraints
from qsync_lab.allocate.fastest import fastest_feasible_plan
from qsync_lab.allocate.frontier import RiskFrontier, risk_frontiers
from qsync_lab.allocate.recover import TIME_RTOL, RecoveryStats, recover_plans
from qsync_lab.cluster import Cluster
from qsync_lab.compress.spec import CompressionSettings
from qsync_lab.costs import CostModel
from qsync_lab.errors import QSyncError
from qsync_lab.graph import OpGraph
from qsync_lab.optimizers import DEFAULT_OPTIMIZER
from qsync_lab.plan import Plan
from qsync_lab.policy import validate_plan
from qsync_lab.precision import Precision
from qsync_lab.simulate import (PlanEvaluator, PreparedGraph, SimResult, prepare_graph, render,
                                simulate)

__all__ = ["Allocation", "Allocator", "allocate", "allocate_detailed", "kinds_to_allocate",
           "prepared_graph", "target_iteration_us"]

_US_PER_S = 1e6


@dataclass(frozen=True)
class Allocation:
    """A plan and how the allocator got there.

    Attributes:
        plan: the plan.
        iteration_us: its predicted iteration time.
        target_us: the largest iteration time the recovery allowed (the constraint's, or
            the fastest feasible plan's when the default pace is out of reach).
        seconds: wall time of the allocation (preparing the graph excluded, and on a
            re-plan what its :class:`Allocator` derived before).
        stats: the recovery's frontier plans tried, greedy trials, accepted moves and
            re-keyings.
        risk: per allocated device kind, the plan's summed indicator.
    """

    plan: Plan
    iteration_us: float
    target_us: float
    seconds: float
    stats: RecoveryStats
    risk: Mapping[str, float] = field(hash=False)


def prepared_graph(graph: "OpGraph | PreparedGraph") -> PreparedGraph:
    """``graph`` prepared for simulation (unchanged if it already is)."""
    return graph if isinstance(graph, PreparedGraph) else prepare_graph(graph)


def target_iteration_us(evaluator: PlanEvaluator, constraints: Constraints) -> float:
    """The largest iteration time the throughput constraint allows on the evaluator's cluster."""
    if constraints.throughput_samples_per_s is not None:
        return evaluator.cluster.global_batch_size * _US_PER_S / constraints.throughput_samples_per_s
    return min(evaluator.pace_us(kind) for kind in evaluator.cluster.device_kinds)


def kinds_to_allocate(evaluator: PlanEvaluator, target_us: float,
                      budgets_bytes: Mapping[str, float]) -> tuple[str, ...]:
    """The kinds slower than the target at fp32, or over their memory budget at fp32."""
    return tuple(kind for kind in evaluator.cluster.device_kinds
                 if evaluator.pace_us(kind) > target_us * (1 + TIME_RTOL)
                 or evaluator.memory_bytes(kind, {}) > budgets_bytes[kind])


def allocate(graph: "OpGraph | PreparedGraph", cluster: Cluster, costs: CostModel,
             indicator: pd.DataFrame, constraints: Constraints | None = None, *,
             optimizer: str = DEFAULT_OPTIMIZER, compression=None) -> Plan:
    """The quantization-minimized plan (see the module docstring).

    Args:
        graph: the model's graph, or :func:`~qsync_lab.simulate.prepare_graph`'s result.
        cluster: the ranks with their batch sizes and the links.
        costs: the cost model.
        indicator: :func:`qsync_lab.indicator.indicator`'s DataFrame (the ops it scores
            are the candidates).
        constraints: memory budgets and the throughput floor (default: device memory,
            the fastest kind's fp32 pace).
        optimizer, compression: as for :func:`~qsync_lab.simulate.simulate`; the plan
            records both.

    Raises:
        QSyncError: a memory budget below what any plan needs (stating the least), or an
            explicit throughput no plan reaches, in one line.
    """
    return allocate_detailed(graph, cluster, costs, indicator, constraints,
                             optimizer=optimizer, compression=compression).plan


def allocate_detailed(graph: "OpGraph | PreparedGraph", cluster: Cluster, costs: CostModel,
                      indicator: pd.DataFrame, constraints: Constraints | None = None, *,
                      optimizer: str = DEFAULT_OPTIMIZER, compression=None,
                      strategy: str = "qsync") -> Allocation:
    """:func:`allocate` with the predicted iteration time, run time and greedy statistics."""
    return Allocator(graph, cluster, costs, indicator, optimizer=optimizer,
                     compression=compression).allocate(constraints, strategy=strategy)


class Allocator:
    """QSync's allocator for one model, cluster, cost model and indicator, kept for re-planning.

    What does not depend on the constraints is derived once: the evaluator of the all-fp32
    plan, with the memo of every plan it evaluates, and per device kind the candidates,
    their chain estimates and frontiers. Each :meth:`allocate` searches from a fork of that
    evaluator, so a re-plan under new constraints (a widget's slider) repeats only the
    search, and each plan it proposes again is a memo hit. The result equals a cold
    :func:`allocate_detailed` with the same arguments.
    """

    def __init__(self, graph: "OpGraph | PreparedGraph", cluster: Cluster, costs: CostModel,
                 indicator: pd.DataFrame, *, optimizer: str = DEFAULT_OPTIMIZER,
                 compression=None) -> None:
        self.prepared = prepared_graph(graph)
        self.cluster, self.costs, self.indicator = cluster, costs, indicator
        self.optimizer, self.compression = optimizer, compression
        self._candidates: dict[str, tuple[OpChoices, ChainCosts, tuple[RiskFrontier, ...]]] = {}

    def simulate(self, plan: Plan) -> SimResult:
        """:func:`~qsync_lab.simulate.simulate` of ``plan`` on the allocator's cluster: from
        a fork of its evaluator (each kind's plan a memo hit once allocated) when the plan
        has the cluster's batch sizes, the optimizer and the compression, else a fresh
        simulation."""
        cluster = plan.apply_to(self.cluster)
        if (cluster.ranks != self.cluster.ranks or plan.optimizer != self.optimizer
                or plan.compression_settings != CompressionSettings.parse(self.compression)):
            return simulate(self.prepared, plan, self.cluster, self.costs)
        evaluator = self.evaluator.fork()
        for kind, ops in validate_plan(plan.precisions, self.prepared.work, cluster.device_kinds,
                                       cluster.catalog).items():
            evaluator.accept(evaluator.propose_plan(kind, ops))
        return render(evaluator, plan.constraints)

    @functools.cached_property
    def evaluator(self) -> PlanEvaluator:
        """The all-fp32 evaluator each allocation forks."""
        return PlanEvaluator(self.prepared, self.cluster, self.costs, optimizer=self.optimizer,
                             compression=self.compression)

    def candidates(self, kind: str) -> tuple[OpChoices, ChainCosts, tuple[RiskFrontier, ...]]:
        """``kind``'s candidates, their chain estimates and frontiers (derived once)."""
        if kind not in self._candidates:
            device, work = self.evaluator.devices[kind], self.prepared.work
            choices = op_choices(work, self.indicator, device)
            batch = max(b for name, b in self.evaluator.classes if name == kind)
            chain = chain_costs(work, choices.ops, device, self.costs, batch_size=batch,
                                memory=self.evaluator.memory_model)
            self._candidates[kind] = choices, chain, risk_frontiers(chain, choices)
        return self._candidates[kind]

    def allocate(self, constraints: Constraints | None = None, *,
                 strategy: str = "qsync") -> Allocation:
        """The allocation under ``constraints`` (see :func:`allocate` for the errors);
        ``strategy`` names it in the plan."""
        constraints = constraints or Constraints()
        cluster, prepared = self.cluster, self.prepared
        start = time.perf_counter()
        evaluator = self.evaluator.fork()
        budgets = {kind: constraints.memory_budget_bytes(cluster, kind)
                   for kind in cluster.device_kinds}
        target_us = target_iteration_us(evaluator, constraints)
        choices: dict[str, OpChoices] = {}
        chains: dict[str, ChainCosts] = {}
        frontiers: dict[str, tuple[RiskFrontier, ...]] = {}
        plans: dict[str, list[Precision]] = {}
        for kind in kinds_to_allocate(evaluator, target_us, budgets):
            choices[kind], chains[kind], frontiers[kind] = self.candidates(kind)
            first = fastest_feasible_plan(evaluator, kind, choices[kind], chains[kind],
                                          budget_bytes=budgets[kind])
            evaluator.accept(evaluator.propose_plan(kind, first))
            plans[kind] = [first[op] for op in choices[kind].ops]
        if constraints.throughput_samples_per_s is None:
            target_us = max(target_us, evaluator.iteration_us)
        elif evaluator.iteration_us > target_us * (1 + TIME_RTOL):
            raise QSyncError(
                f"no plan reaches the throughput target: best reachable "
                f"{evaluator.iteration_us / 1e3:.3f} ms per iteration "
                f"({cluster.global_batch_size * _US_PER_S / evaluator.iteration_us:.1f} "
                f"samples/s), target {target_us / 1e3:.3f} ms "
                f"({cluster.global_batch_size * _US_PER_S / target_us:.1f} samples/s); "
                "lower the throughput constraint or raise the memory budget")
        stats = recover_plans(evaluator, choices, chains, plans, target_us=target_us,
                              budgets_bytes=budgets, frontiers=frontiers)
        seconds = time.perf_counter() - start
        names = prepared.work.names
        precisions = {kind: {names[op]: p for op, p in zip(choices[kind].ops, plans[kind])}
                      for kind in choices}
        plan = Plan.build(prepared.graph, cluster, precisions, strategy=strategy,
                          optimizer=self.optimizer, compression=self.compression,
                          constraints=constraints)
        risk = {kind: choices[kind].risk(dict(zip(choices[kind].ops, plans[kind])))
                for kind in choices}
        return Allocation(plan, evaluator.iteration_us, target_us, seconds, stats, risk)
