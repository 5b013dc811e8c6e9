"""The least-risk plan of one device kind for every estimated time (or memory): a knapsack
over the chain.

The greedy recovery alone is a knapsack greedy and can miss the optimum by far (it fills
the budget move by move and drops what no longer fits). This dynamic program solves the
knapsack on the chain estimates of :mod:`~qsync_lab.allocate.chain` instead. With
``resource="time"`` a plan's cost is the sum over candidates of the node cost plus the
cast from the previous candidate; with ``"memory"``, the sum of the candidates' memory.
Its risk is the summed indicator. The state is (candidate, its precision, cost so far),
the cost rounded to ``buckets`` steps of the range between the cheapest and the dearest
plan; one pass gives, for every cost, the plan of least risk costing at most that (the
*frontier*: risk falls as cost rises). The estimates only rank plans: the allocator
checks each frontier plan it tries with the simulator.

Example::

    >>> from qsync_lab.allocate.exact import AdditiveInstance
    >>> inst = AdditiveInstance.random(ops=6, seed=0)
    >>> frontier = risk_frontier(inst.chain(), inst.choices)
    >>> bool((frontier.risk[1:] < frontier.risk[:-1]).all()), float(frontier.risk[-1])
    (True, 0.0)
    >>> [str(p) for p in frontier.plan(len(frontier.risk) - 1)] == ["fp32"] * 6
    True
"""

from dataclasses import dataclass

import numpy as np

from qsync_lab.allocate.chain import ChainCosts
from qsync_lab.allocate.choices import OpChoices
from qsync_lab.precision import Precision

__all__ = ["RESOURCES", "RiskFrontier", "risk_frontier", "risk_frontiers"]

BUCKETS = 2000
#: what a frontier trades risk against
RESOURCES = ("time", "memory")


@dataclass(frozen=True, eq=False)
class RiskFrontier:
    """Plans of least risk per estimated cost, by rising cost (``risk`` falls).

    Attributes:
        cost: per point, the estimated cost above the cheapest plan (rounded; µs or bytes).
        risk: per point, the summed indicator of its plan.
    """

    cost: np.ndarray
    risk: np.ndarray
    _precisions: tuple[Precision, ...]
    _steps: np.ndarray   # [candidate, previous column, column] rounded cost of the step
    _back: np.ndarray    # [candidate, column, cost] the previous candidate's best column
    _last: np.ndarray    # [cost] the last candidate's best column
    _points: np.ndarray  # per point, its cost index

    def plan(self, i: int) -> tuple[Precision, ...]:
        """The precision of every candidate in point ``i``'s plan."""
        t = int(self._points[i])
        column = int(self._last[t])
        path = []
        for k in range(len(self._steps) - 1, -1, -1):
            path.append(self._precisions[column])
            previous = int(self._back[k, column, t])
            t -= int(self._steps[k, previous, column])
            column = previous
        return tuple(reversed(path))


def risk_frontier(chain: ChainCosts, choices: OpChoices, *, resource: str = "time",
                  buckets: int = BUCKETS) -> RiskFrontier:
    """The frontier of ``choices`` on ``chain`` in ``resource`` ("time" or "memory")."""
    if resource not in RESOURCES:
        raise ValueError(f"resource must be 'time' or 'memory', got {resource!r}")
    precisions = chain.precisions
    n, width = len(choices.ops), len(precisions)
    cost = np.full((n, width, width), np.inf)   # [k, previous column, column]
    risk = np.full((n, width), np.inf)
    for k, ladder in enumerate(choices.ladders):
        for p in ladder:
            c = chain.column(p)
            risk[k, c] = choices.op_risk[k][p]
            cost[k, :, c] = ([chain.node_us[k, c] + chain.edge_us(k, q if k else None, p)
                              for q in precisions] if resource == "time"
                             else chain.mem_bytes[k, c])
    finite = np.isfinite(cost)
    low = cost.min(axis=(1, 2))
    spread = np.where(finite, cost - low[:, None, None], 0.0)
    unit = float(spread.max(axis=(1, 2), initial=0.0).sum()) / buckets or 1.0
    steps = np.rint(spread / unit).astype(np.int64)
    size = int(steps.max(axis=(1, 2), initial=0).sum()) + 1
    best = np.zeros((width, size))   # [column, cost]: least risk spending at most cost
    back = np.zeros((n, width, size), np.int8)
    for k in range(n):
        shifted = np.full((width, width, size), np.inf)   # [previous, column, cost]
        for q in range(width):
            for c in range(width):
                if finite[k, q, c]:
                    s = steps[k, q, c]
                    shifted[q, c, s:] = best[q, :size - s]
        back[k] = shifted.argmin(axis=0)
        best = risk[k][:, None] + shifted.min(axis=0)
    least = best.min(axis=0)
    points = np.flatnonzero(np.isfinite(least) & (least < np.r_[np.inf, least[:-1]]))
    return RiskFrontier(points * unit, least[points], precisions, steps, back,
                        best.argmin(axis=0), points)


def risk_frontiers(chain: ChainCosts, choices: OpChoices) -> tuple[RiskFrontier, ...]:
    """The frontiers of ``choices`` on ``chain`` in each of :data:`RESOURCES`."""
    return tuple(risk_frontier(chain, choices, resource=resource) for resource in RESOURCES)
