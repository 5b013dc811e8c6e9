"""QSync's greedy recovery, with its bugs fixed.

Start from a low-precision plan that meets the constraints. Every candidate op offers one
move: to the next precision of its ladder (less risk). A max-heap orders the moves by
indicator reduction per added microsecond (the largest first; QSync's heap popped the
smallest); moves that save time or cost none come first. The time of a move is an
estimate (it depends on the neighbours' precisions), so a popped move is re-keyed with the
current neighbours and pushed back if it dropped below the next one (lazy re-keying).
Each move is then evaluated exactly and accepted only if the predicted iteration time
stays within the target and the kind's memory within its budget; an accepted op offers
its next move. A rejected move leaves nothing behind (proposals are values), and the op
is dropped, as in QSync.

The loop works on any evaluator with ``propose(kind, {op: precision})`` returning an
object with ``iteration_us`` and ``peak_memory_bytes``, and ``accept(proposal)``: the
simulator-backed :class:`~qsync_lab.allocate.PlanEvaluator` or the additive instances of
:mod:`qsync_lab.allocate.exact`.

Example::

    >>> from qsync_lab.allocate.exact import AdditiveInstance
    >>> inst = AdditiveInstance.random(ops=6, seed=0)
    >>> plan, stats = greedy_recover_instance(inst)
    >>> bool(inst.time_us(plan) <= inst.target_us), stats.accepted <= stats.trials
    (True, True)
"""

import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from qsync_lab.allocate.choices import OpChoices
from qsync_lab.precision import Precision

__all__ = ["RecoveryStats", "greedy_recover", "greedy_recover_instance"]

#: relative slack on the time target, against float round-off in the replay
TIME_RTOL = 1e-9

MoveUs = Callable[[str, int, Sequence[Precision], Precision], float]
ORDERS = ("ratio", "gain")


@dataclass(frozen=True)
class RecoveryStats:
    """How the greedy went: moves evaluated exactly, accepted, and re-keyed."""

    trials: int
    accepted: int
    rekeyed: int


def greedy_recover(evaluator, choices: Mapping[str, OpChoices],
                   plans: Mapping[str, list[Precision]], move_us: MoveUs, *,
                   target_us: float, budgets_bytes: Mapping[str, float],
                   order: str = "ratio") -> RecoveryStats:
    """Climb the ladders of ``choices`` in place (see the module docstring).

    Args:
        evaluator: holds the current plan of every kind (starting from ``plans``).
        choices: device kind -> its candidates.
        plans: device kind -> per candidate its current precision; updated in place.
        move_us: ``(kind, k, plan, precision)`` -> estimated time change of moving
            candidate ``k`` to ``precision``.
        target_us: the largest iteration time allowed.
        budgets_bytes: device kind -> per-rank memory budget.
        order: ``"ratio"`` pops the largest indicator reduction per added µs first (QSync's
            rule, fixed); ``"gain"`` the largest reduction first. Each can beat the other
            (a knapsack greedy), so :func:`best_of_orders` runs both.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    heap: list[tuple] = []
    counter = itertools.count()
    limit_us = target_us * (1 + TIME_RTOL)

    def move(kind: str, k: int) -> tuple | None:
        c, current = choices[kind], plans[kind][k]
        ladder = c.ladders[k]
        position = ladder.index(current)
        if position + 1 == len(ladder):
            return None
        target = ladder[position + 1]
        gain = c.omega[k][current] - c.omega[k][target]
        delta_us = move_us(kind, k, plans[kind], target)
        if gain <= 0 and delta_us >= 0:
            return None
        ratio = math.inf if delta_us <= 0 else gain / delta_us
        first, second = (ratio, gain) if order == "ratio" else (
            (math.inf, ratio) if delta_us <= 0 else (gain, ratio))
        return (-first, -second, next(counter), kind, k, target)

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
        if proposal.iteration_us <= limit_us and proposal.peak_memory_bytes <= budgets_bytes[kind]:
            evaluator.accept(proposal)
            plans[kind][k] = target
            accepted += 1
            following = move(kind, k)
            if following is not None:
                heapq.heappush(heap, following)
    return RecoveryStats(trials, accepted, rekeyed)


def greedy_recover_instance(instance, order: str = "best") -> tuple[dict[int, Precision],
                                                                      RecoveryStats]:
    """Run the greedy on an :class:`~qsync_lab.allocate.exact.AdditiveInstance` from its
    fastest start (``order``: "ratio", "gain", or "best" of both); returns the plan
    (candidate position -> precision) and the stats."""
    runs = []
    for each in (ORDERS if order == "best" else (order,)):
        evaluator = instance.evaluator()
        plans = {instance.KIND: list(instance.fastest_plan())}
        stats = greedy_recover(evaluator, {instance.KIND: instance.choices}, plans,
                               lambda _, k, plan, p: instance.move_us(k, plan[k], p),
                               target_us=instance.target_us,
                               budgets_bytes={instance.KIND: instance.budget_bytes}, order=each)
        plan = dict(enumerate(plans[instance.KIND]))
        runs.append((instance.risk(plan), plan, stats))
    _, plan, stats = min(runs, key=lambda run: run[0])
    return plan, stats
