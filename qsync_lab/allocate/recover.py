"""Recovery: from a low-precision plan within the limits, raise precisions while the
predicted iteration time stays within the target and each kind's memory within its
budget, to the least summed indicator (risk) found. Every plan tried is checked exactly
by the evaluator (a trial is a proposal: a rejected one leaves nothing behind).

1. :func:`frontier_start`: per device kind, the frontiers of least-risk plans per
   estimated time and per estimated memory (:func:`~qsync_lab.allocate.risk_frontier`,
   knapsacks over the chain estimates) are bisected for their least-risk plan that the
   evaluator accepts. This finds the knapsack optima that a greedy alone misses (on
   additive instances the greedy alone can end well above the optimum).
2. :func:`greedy_recover`: QSync's greedy, with its bugs fixed, fills what slack the
   estimates left (they ignore some casts and the overlap with communication, which the
   exact trials see). It runs from the frontier's plan and, if that differs, from the
   original start; the plan of less risk is kept. Every candidate op offers one move: to
   the next precision of its ladder. A max-heap orders the moves by indicator reduction
   per added microsecond (the largest first; QSync's heap popped the smallest); moves
   that save time or cost none come first. The time of a move is an estimate (it depends
   on the neighbours' precisions), so a popped move is re-keyed with the current
   neighbours and pushed back if it dropped below the next one (lazy re-keying). An
   accepted op offers its next move; a rejected one is dropped, as in QSync.
3. :func:`~qsync_lab.allocate.prune.prune_plans`: a kind whose all-fp32 plan is no slower
   gets it back, and so does every op whose low precision buys neither time nor memory:
   a plan is never predicted slower than fp32 or than the plan without one of its ops.

Both work on any evaluator with ``propose(kind, {op: precision})`` returning an object
with ``iteration_us`` and ``tensor_peak_bytes``, and ``accept(proposal)``: the
simulator-backed :class:`~qsync_lab.simulate.PlanEvaluator` or the additive instances of
:mod:`qsync_lab.allocate.exact`.

Example::

    >>> from qsync_lab.allocate.exact import AdditiveInstance
    >>> inst = AdditiveInstance.random(ops=6, seed=0)
    >>> plan, stats = recover_instance(inst)
    >>> bool(inst.time_us(plan) <= inst.target_us), stats.accepted <= stats.trials
    (True, True)
"""

import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from qsync_lab.allocate.chain import ChainCosts
from qsync_lab.allocate.choices import OpChoices
from qsync_lab.allocate.frontier import RiskFrontier, risk_frontiers
from qsync_lab.allocate.prune import prune_plans
from qsync_lab.precision import Precision

__all__ = ["RecoveryStats", "frontier_start", "greedy_recover", "recover_instance",
           "recover_plans"]

#: relative slack on the time target, against float round-off in the replay
TIME_RTOL = 1e-9

MoveUs = Callable[[str, int, Sequence[Precision], Precision], float]


@dataclass(frozen=True)
class RecoveryStats:
    """How the recovery went: frontier plans evaluated, greedy moves evaluated, accepted
    and re-keyed, and ops given back fp32 because their low precision bought nothing."""

    probes: int
    trials: int
    accepted: int
    rekeyed: int
    pruned: int = 0


def recover_plans(evaluator, choices: Mapping[str, OpChoices],
                  chains: Mapping[str, ChainCosts], plans: Mapping[str, list[Precision]], *,
                  target_us: float, budgets_bytes: Mapping[str, float],
                  frontiers: Mapping[str, Sequence[RiskFrontier]] | None = None
                  ) -> RecoveryStats:
    """Recover in place (see the module docstring); the evaluator ends holding the result.

    Args:
        evaluator: holds the current plan of every kind (``plans``, within the limits).
        choices: device kind -> its candidates.
        chains: device kind -> the chain estimates of its candidates.
        plans: device kind -> per candidate its current precision; updated in place.
        target_us: the largest iteration time allowed.
        budgets_bytes: device kind -> per-rank memory budget.
        frontiers: device kind -> :func:`~qsync_lab.allocate.risk_frontiers` of its
            candidates (default: derived here from the chain estimates).
    """
    start = {kind: list(plans[kind]) for kind in choices}
    probes = 0
    for kind in choices:
        kind_frontiers = (frontiers[kind] if frontiers is not None
                          else risk_frontiers(chains[kind], choices[kind]))
        plans[kind][:], count = frontier_start(evaluator, kind, choices[kind], kind_frontiers,
                                               plans[kind], target_us=target_us,
                                               budget_bytes=budgets_bytes[kind])
        probes += count
    runs, counts = [], []
    for first in ([plans] if plans == start else [plans, start]):
        if runs:   # back to the original start
            _install(evaluator, choices, first)
        filled = {kind: list(first[kind]) for kind in choices}
        counts.append(greedy_recover(
            evaluator, choices, filled, lambda kind, k, plan, p: chains[kind].move_us(k, plan, p),
            target_us=target_us, budgets_bytes=budgets_bytes))
        runs.append(filled)
    risks = [sum(c.risk(dict(zip(c.ops, run[kind]))) for kind, c in choices.items())
             for run in runs]
    best = risks.index(min(risks))
    if best != len(runs) - 1:
        _install(evaluator, choices, runs[best])
    for kind in choices:
        plans[kind][:] = runs[best][kind]
    trials, accepted, rekeyed = map(sum, zip(*counts))
    pruned = prune_plans(evaluator, choices, plans, budgets_bytes)
    return RecoveryStats(probes, trials, accepted, rekeyed, pruned)


def frontier_start(evaluator, kind: str, choices: OpChoices,
                   frontiers: Sequence[RiskFrontier], plan: Sequence[Precision], *,
                   target_us: float, budget_bytes: float) -> tuple[list[Precision], int]:
    """The least-risk plan within the limits found on ``kind``'s ``frontiers`` (in time
    and in memory: :func:`~qsync_lab.allocate.risk_frontiers`), each bisected over its
    plans of less risk than ``plan`` (which is within the limits); ``plan`` if none is.
    The evaluator ends holding it. Returns the plan and the number of plans evaluated."""
    best, kept, probes = list(plan), None, 0
    for frontier in frontiers:
        points = np.flatnonzero(frontier.risk < choices.risk(dict(zip(choices.ops, best))))
        low, high = -1, len(points)
        while high - low > 1:
            middle = (low + high) // 2
            candidate = frontier.plan(points[middle])
            proposal = evaluator.propose(kind, dict(zip(choices.ops, candidate)))
            probes += 1
            if _fits(proposal, target_us, budget_bytes):
                best, kept, low = list(candidate), proposal, middle
            else:
                high = middle
    if kept is not None:
        evaluator.accept(kept)
    return best, probes


def greedy_recover(evaluator, choices: Mapping[str, OpChoices],
                   plans: Mapping[str, list[Precision]], move_us: MoveUs, *,
                   target_us: float, budgets_bytes: Mapping[str, float]
                   ) -> tuple[int, int, int]:
    """Climb the ladders of ``choices`` in place, largest indicator reduction per added
    microsecond first (step 2 of the module docstring). Arguments as for
    :func:`recover_plans`, with ``move_us``: ``(kind, k, plan, precision)`` -> estimated
    time change of moving candidate ``k`` to ``precision``. Returns the moves evaluated,
    accepted and re-keyed."""
    heap: list[tuple] = []
    counter = itertools.count()

    def move(kind: str, k: int) -> tuple | None:
        c, current = choices[kind], plans[kind][k]
        ladder = c.ladders[k]
        position = ladder.index(current)
        if position + 1 == len(ladder):
            return None
        target = ladder[position + 1]
        gain = c.op_risk[k][current] - c.op_risk[k][target]
        delta_us = move_us(kind, k, plans[kind], target)
        if gain <= 0 and delta_us >= 0:
            return None
        ratio = math.inf if delta_us <= 0 else gain / delta_us
        return (-ratio, -gain, next(counter), kind, k, target)

    for kind, c in choices.items():
        for k in range(len(c.ops)):
            entry = move(kind, k)
            if entry is not None:
                heapq.heappush(heap, entry)
    trials = accepted = rekeyed = 0
    while heap:
        entry = heapq.heappop(heap)
        fresh = move(entry[3], entry[4])
        if fresh is None:
            continue
        if heap and fresh[:2] > heap[0][:2] and fresh[:2] != entry[:2]:
            heapq.heappush(heap, fresh)
            rekeyed += 1
            continue
        _, _, _, kind, k, target = fresh
        trials += 1
        proposal = evaluator.propose(kind, {choices[kind].ops[k]: target})
        if _fits(proposal, target_us, budgets_bytes[kind]):
            evaluator.accept(proposal)
            plans[kind][k] = target
            accepted += 1
            following = move(kind, k)
            if following is not None:
                heapq.heappush(heap, following)
    return trials, accepted, rekeyed


def recover_instance(instance) -> tuple[dict[int, Precision], RecoveryStats]:
    """:func:`recover_plans` on an :class:`~qsync_lab.allocate.exact.AdditiveInstance` from
    its fastest start; returns the plan (candidate position -> precision) and the stats."""
    kind = instance.KIND
    plans = {kind: list(instance.fastest_plan())}
    stats = recover_plans(instance.evaluator(), {kind: instance.choices},
                          {kind: instance.chain()}, plans, target_us=instance.target_us,
                          budgets_bytes={kind: instance.budget_bytes})
    return dict(enumerate(plans[kind])), stats


def _install(evaluator, choices: Mapping[str, OpChoices],
             plans: Mapping[str, Sequence[Precision]]) -> None:
    for kind, c in choices.items():
        evaluator.accept(evaluator.propose(kind, dict(zip(c.ops, plans[kind]))))


def _fits(proposal, target_us: float, budget_bytes: float) -> bool:
    return (proposal.iteration_us <= target_us * (1 + TIME_RTOL)
            and proposal.tensor_peak_bytes <= budget_bytes)
