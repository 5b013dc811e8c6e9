"""Exact optimum of small allocations, to measure the allocator's optimality gap.

The exact problem is solved on an *additive* (linearized) instance, and the allocator's
recovery (:func:`~qsync_lab.allocate.recover_plans`) is run on the same instance, with the
instance's own costs as its chain estimates (:meth:`AdditiveInstance.chain`), so the gap
compares the two searches and nothing else:

* time: the allocated kind's compute time (its backward end) is its fp32 value plus, per
  candidate, the change measured by the simulator with only that op moved off fp32. Casts
  are thereby included as each op sees them next to fp32 neighbours (linearized around
  fp32); interactions between neighbouring low-precision ops are ignored by both sides.
* memory: likewise, the per-rank peak at fp32 plus each op's measured change.
* constraints: time <= the fastest kind's fp32 compute time (the pace) and memory <=
  the budget; objective: the summed indicator.

:func:`exact_plan` solves it as a 0/1 integer program with :func:`scipy.optimize.milp`
(one binary per op and precision, one precision per op).

Example::

    >>> inst = AdditiveInstance.random(ops=8, seed=1)
    >>> gap = optimality_gap(inst)
    >>> gap.exact_risk <= gap.recovered_risk + 1e-12
    True
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from qsync_lab.allocate.chain import ChainCosts
from qsync_lab.allocate.choices import OpChoices
from qsync_lab.simulate import PlanEvaluator
from qsync_lab.allocate.recover import recover_instance
from qsync_lab.devices import load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision

__all__ = ["AdditiveInstance", "OptimalityGap", "exact_plan", "linearized_instance",
           "optimality_gap"]

_BISECTION_STEPS = 40


@dataclass(frozen=True, eq=False)
class AdditiveInstance:
    """An allocation problem of one device kind whose time and memory add up per op.

    Attributes:
        choices: the candidates (ladders and indicator).
        base_us, base_bytes: time and memory with every candidate in fp32.
        delta_us, delta_bytes: per candidate, precision -> change from fp32.
        target_us: the largest time allowed.
        budget_bytes: the largest memory allowed.
    """

    KIND = "instance"

    choices: OpChoices
    base_us: float
    base_bytes: float
    delta_us: tuple[Mapping[Precision, float], ...]
    delta_bytes: tuple[Mapping[Precision, float], ...]
    target_us: float
    budget_bytes: float

    @classmethod
    def random(cls, *, ops: int, seed: int = 0, slack: float = 0.5) -> "AdditiveInstance":
        """A synthetic T4-like instance: int8 saves ~2x the time fp16 saves and risks more;
        the time target lies ``slack`` of the way from the fastest plan to all fp32."""
        rng = np.random.default_rng(seed)
        t4 = load_catalog().device("T4")
        ladder = (Precision.INT8, Precision.FP16, Precision.FP32)
        fp32_us = rng.uniform(50, 500, ops)
        weight_bytes = rng.uniform(1e5, 1e7, ops)
        risk, delta_us, delta_bytes = [], [], []
        for k in range(ops):
            fp16 = float(rng.uniform(0.01, 1.0))
            risk.append(MappingProxyType({Precision.INT8: fp16 * rng.uniform(2, 20),
                                          Precision.FP16: fp16, Precision.FP32: 0.0}))
            delta_us.append(MappingProxyType({Precision.INT8: -0.75 * fp32_us[k],
                                              Precision.FP16: -0.5 * fp32_us[k],
                                              Precision.FP32: 0.0}))
            delta_bytes.append(MappingProxyType({Precision.INT8: -0.5 * weight_bytes[k],
                                                 Precision.FP16: -0.3 * weight_bytes[k],
                                                 Precision.FP32: 0.0}))
        choices = OpChoices(t4, tuple(range(ops)), (ladder,) * ops, tuple(risk))
        base_us = float(fp32_us.sum())
        fastest_us = base_us - 0.75 * base_us
        return cls(choices, base_us, float(4 * weight_bytes.sum()), tuple(delta_us),
                   tuple(delta_bytes), fastest_us + slack * (base_us - fastest_us),
                   float(4 * weight_bytes.sum()))

    def time_us(self, plan: Mapping[int, Precision]) -> float:
        """Time of ``plan`` (candidate position -> precision)."""
        return self.base_us + sum(self.delta_us[k][p] for k, p in plan.items())

    def memory_bytes(self, plan: Mapping[int, Precision]) -> float:
        return self.base_bytes + sum(self.delta_bytes[k][p] for k, p in plan.items())

    def risk(self, plan: Mapping[int, Precision]) -> float:
        return float(sum(self.choices.op_risk[k][p] for k, p in plan.items()))

    def move_us(self, k: int, old: Precision, new: Precision) -> float:
        return self.delta_us[k][new] - self.delta_us[k][old]

    def fastest_plan(self) -> tuple[Precision, ...]:
        """Per candidate the fastest precision; if that exceeds the budget, the fastest
        under a memory penalty raised until it fits (as :mod:`~qsync_lab.allocate.fastest`)."""
        def plan_for(weight: float) -> tuple[Precision, ...]:
            return tuple(min(ladder, key=lambda p: (self.delta_us[k][p]
                                                   + weight * self.delta_bytes[k][p]))
                         for k, ladder in enumerate(self.choices.ladders))

        def fits(plan: Sequence[Precision]) -> bool:
            return self.memory_bytes(dict(enumerate(plan))) <= self.budget_bytes

        plan = plan_for(0.0)
        if fits(plan):
            return plan
        low, high = -14.0, 4.0
        best = plan_for(10.0 ** high)
        if not fits(best):
            raise QSyncError("the instance's memory budget is below its least memory")
        for _ in range(_BISECTION_STEPS):
            middle = (low + high) / 2
            plan = plan_for(10.0 ** middle)
            if fits(plan):
                best, high = plan, middle
            else:
                low = middle
        return best

    def chain(self) -> ChainCosts:
        """The instance as a chain without casts: node cost = time change from fp32."""
        precisions = self.choices.device.precision_list
        node, memory = (np.full((len(self.delta_us), len(precisions)), np.inf) for _ in range(2))
        for k, (times, sizes) in enumerate(zip(self.delta_us, self.delta_bytes)):
            for p in times:
                node[k, precisions.index(p)] = times[p]
                memory[k, precisions.index(p)] = sizes[p]
        no_cast = np.zeros(len(self.delta_us))
        return ChainCosts(tuple(range(len(self.delta_us))), precisions, node, memory, no_cast,
                          {(a, b): no_cast for a in Precision for b in Precision})

    def evaluator(self) -> "_AdditiveEvaluator":
        """An evaluator of this instance for :func:`~qsync_lab.allocate.recover_plans`."""
        return _AdditiveEvaluator(self)


@dataclass(frozen=True)
class _Proposal:
    plan: Mapping[int, Precision]
    iteration_us: float
    tensor_peak_bytes: float


class _AdditiveEvaluator:
    """``propose``/``accept`` over an :class:`AdditiveInstance` (op ids are positions)."""

    def __init__(self, instance: AdditiveInstance) -> None:
        self.instance = instance
        self.plan = dict(enumerate(instance.fastest_plan()))

    def propose(self, kind: str, changes: Mapping[int, Precision]) -> _Proposal:
        plan = {**self.plan, **changes}
        return _Proposal(plan, self.instance.time_us(plan), self.instance.memory_bytes(plan))

    @property
    def iteration_us(self) -> float:
        return self.instance.time_us(self.plan)

    def accept(self, proposal: _Proposal) -> None:
        self.plan = dict(proposal.plan)


def exact_plan(instance: AdditiveInstance) -> dict[int, Precision]:
    """The plan of least summed indicator meeting the time and memory limits (MILP).

    Raises:
        QSyncError: no plan meets them.
    """
    columns = [(k, p) for k, ladder in enumerate(instance.choices.ladders) for p in ladder]
    n_ops = len(instance.choices.ladders)
    risk = np.array([instance.choices.op_risk[k][p] for k, p in columns])
    one_each = np.zeros((n_ops, len(columns)))
    for j, (k, _) in enumerate(columns):
        one_each[k, j] = 1.0
    time = np.array([instance.delta_us[k][p] for k, p in columns])
    memory = np.array([instance.delta_bytes[k][p] for k, p in columns])
    constraints = [LinearConstraint(one_each, 1, 1),
                   LinearConstraint(time[None, :], -np.inf, instance.target_us - instance.base_us),
                   LinearConstraint(memory[None, :] / 2**20, -np.inf,
                                    (instance.budget_bytes - instance.base_bytes) / 2**20)]
    result = milp(risk, constraints=constraints, integrality=np.ones(len(columns)),
                  bounds=Bounds(0, 1))
    if result.status != 0 or result.x is None:
        raise QSyncError(f"no plan meets the time and memory limits ({result.message})")
    return {k: p for (k, p), x in zip(columns, result.x) if x > 0.5}


@dataclass(frozen=True)
class OptimalityGap:
    """Summed indicator of the recovered plan and of the exact optimum on one instance.

    Attributes:
        recovered_risk, exact_risk: summed indicator of each plan.
        gap: ``recovered_risk / exact_risk - 1`` (0 when both are 0).
        recovered_us, exact_us: each plan's time.
    """

    recovered_risk: float
    exact_risk: float
    recovered_us: float
    exact_us: float

    @property
    def gap(self) -> float:
        if self.exact_risk <= 0:
            return 0.0 if self.recovered_risk <= 0 else float("inf")
        return self.recovered_risk / self.exact_risk - 1.0


def optimality_gap(instance: AdditiveInstance) -> OptimalityGap:
    """Solve ``instance`` with the recovery and exactly and compare their summed indicator."""
    recovered, _ = recover_instance(instance)
    exact = exact_plan(instance)
    return OptimalityGap(instance.risk(recovered), instance.risk(exact),
                         instance.time_us(recovered), instance.time_us(exact))


def linearized_instance(evaluator: PlanEvaluator, kind: str, choices: OpChoices, *,
                        budget_bytes: float) -> AdditiveInstance:
    """The additive instance of ``kind`` on a real model (see the module docstring).

    ``evaluator`` must hold the all-fp32 plan; the pace is the fastest kind's fp32
    compute time (the smallest backward end among the other classes).
    """
    if any(evaluator.plan(name) for name in evaluator.devices):
        raise QSyncError("linearized_instance needs an evaluator holding the all-fp32 plan")

    def compute_us(proposal) -> float:
        return max(line.backward_end_us for line in proposal.timelines)

    base = evaluator.propose(kind, {})
    delta_us, delta_bytes = [], []
    for op, ladder in zip(choices.ops, choices.ladders):
        times, memory = {}, {}
        for p in ladder:
            trial = evaluator.propose(kind, {op: p})
            times[p] = compute_us(trial) - compute_us(base)
            memory[p] = trial.tensor_peak_bytes - base.tensor_peak_bytes
        delta_us.append(MappingProxyType(times))
        delta_bytes.append(MappingProxyType(memory))
    pace_us = min(evaluator.propose(name, {}).timelines[0].backward_end_us
                  for name in evaluator.devices if name != kind)
    positions = tuple(range(len(choices.ops)))
    local = OpChoices(choices.device, positions, choices.ladders, choices.op_risk)
    return AdditiveInstance(local, compute_us(base), base.tensor_peak_bytes, tuple(delta_us),
                            tuple(delta_bytes), pace_us, budget_bytes)
