"""The fastest plan of one device kind that fits its memory budget.

QSync meant to start its greedy from the fastest plan but shipped with that search
commented out (every op fp16). Here the main start is a Viterbi pass over the op chain
(:mod:`qsync_lab.allocate.chain`): per candidate a precision, minimising node costs plus
the casts between neighbours, plus ``memory_weight`` x memory. With weight 0 that is the
fastest plan; if it does not fit the budget, the weight is raised (bisection on a log
scale) until the plan fits, which trades the least time for memory. Without memory
pressure the Viterbi plan competes with two simple ones (every op in its narrowest
precision; every op in its fastest by node cost alone) and the simulator's fastest of the
three that fit wins, so the start is never slower than uniform low precision. The memory
of every plan tried is the simulator's, not the chain estimate. If even the plan of least
memory (the heaviest weight's, or one of the three) does not fit, the error states its
memory as the least feasible budget.

Example::

    >>> import pandas as pd
    >>> import torch, torch.nn as nn
    >>> from qsync_lab.cluster import load_cluster
    >>> from qsync_lab.costs import CostModel
    >>> from qsync_lab.graph import trace_graph
    >>> from qsync_lab.simulate import PlanEvaluator, prepare_graph
    >>> from qsync_lab.allocate import chain_costs, op_choices
    >>> graph = trace_graph(nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(),
    ...                                   nn.Linear(4096, 1024)), torch.randn(4, 64, 1024))
    >>> ev = PlanEvaluator(prepare_graph(graph), load_cluster("v100-t4-small"), CostModel())
    >>> scores = pd.DataFrame({("fp16", "risk"): [1.0, 1.0], ("int8", "risk"): [2.0, 2.0]},
    ...                       index=["0", "2"])
    >>> choices = op_choices(ev.prepared.work, scores, ev.devices["T4"])
    >>> chain = chain_costs(ev.prepared.work, choices.ops, ev.devices["T4"], CostModel(),
    ...                     batch_size=32, memory=ev.memory_model)
    >>> plan = fastest_feasible_plan(ev, "T4", choices, chain, budget_bytes=16 * 2**30)
    >>> sorted(str(p) for p in plan.values())
    ['fp16', 'fp16']
"""

from collections.abc import Sequence

import numpy as np

from qsync_lab.allocate.chain import ChainCosts
from qsync_lab.allocate.choices import OpChoices
from qsync_lab.simulate import PlanEvaluator
from qsync_lab.devices import BYTES_PER_GIB
from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision

__all__ = ["chain_viterbi", "fastest_feasible_plan"]

_BISECTION_STEPS = 24
_LOG10_WEIGHT_RANGE = (-14.0, 2.0)   # microseconds per byte


def chain_viterbi(chain: ChainCosts, choices: OpChoices, *, memory_weight: float = 0.0
                  ) -> tuple[Precision, ...]:
    """Per candidate the precision minimising the chain cost plus ``memory_weight`` x memory.

    Only the precisions of each candidate's ladder are allowed; ties go to the earlier
    precision of the device's list (the wider one).
    """
    allowed = np.full(chain.node_us.shape, np.inf)
    for k, ladder in enumerate(choices.ladders):
        allowed[k, [chain.column(p) for p in ladder]] = 0.0
    node = chain.node_us + memory_weight * chain.mem_bytes + allowed
    precisions = chain.precisions
    n, width = node.shape
    if n == 0:
        return ()
    back = np.zeros((n, width), np.int64)
    cost = node[0] + np.array([chain.edge_us(0, None, p) for p in precisions])
    for k in range(1, n):
        edges = np.array([[chain.edge_us(k, prev, p) for p in precisions] for prev in precisions])
        total = cost[:, None] + edges
        back[k] = total.argmin(axis=0)
        cost = node[k] + total.min(axis=0)
    column = int(cost.argmin())
    path = [column]
    for k in range(n - 1, 0, -1):
        column = int(back[k, column])
        path.append(column)
    return tuple(precisions[c] for c in reversed(path))


def fastest_feasible_plan(evaluator: PlanEvaluator, kind: str, choices: OpChoices,
                          chain: ChainCosts, *, budget_bytes: float) -> dict[int, Precision]:
    """The fastest plan (op index -> precision, every candidate) of ``kind`` within budget.

    Raises:
        QSyncError: no plan fits; the message gives the least memory of the plans tried.
    """
    def plan_for(weight: float) -> dict[int, Precision]:
        return _as_plan(choices.ops, chain_viterbi(chain, choices, memory_weight=weight))

    starts = (plan_for(0.0), _narrowest(choices), _fastest_nodes(chain, choices))
    fitting = [plan for plan in starts if evaluator.memory_bytes(kind, plan) <= budget_bytes]
    if fitting:
        return min(fitting, key=lambda plan: _compute_us(evaluator, kind, plan))
    low, high = _LOG10_WEIGHT_RANGE
    smallest = plan_for(10.0 ** high)
    least_bytes = min(evaluator.memory_bytes(kind, plan) for plan in (smallest, *starts))
    if least_bytes > budget_bytes:
        raise QSyncError(f"{kind} needs at least {least_bytes / BYTES_PER_GIB:.3g} GiB per rank "
                         f"for this model and batch, the budget is "
                         f"{budget_bytes / BYTES_PER_GIB:.3g} GiB; raise the budget or lower "
                         f"{kind}'s batch size")
    best = smallest
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        plan = plan_for(10.0 ** middle)
        if evaluator.memory_bytes(kind, plan) <= budget_bytes:
            best, high = plan, middle
        else:
            low = middle
    return best


def _narrowest(choices: OpChoices) -> dict[int, Precision]:
    """Every candidate in its narrowest precision (uniform low precision)."""
    return {op: min(ladder, key=lambda p: p.bits) for op, ladder in zip(choices.ops, choices.ladders)}


def _fastest_nodes(chain: ChainCosts, choices: OpChoices) -> dict[int, Precision]:
    """Every candidate in its fastest precision by node cost alone (casts ignored)."""
    return {op: min(ladder, key=lambda p: chain.node_us[k, chain.column(p)])
            for k, (op, ladder) in enumerate(zip(choices.ops, choices.ladders))}


def _compute_us(evaluator: PlanEvaluator, kind: str, plan: dict[int, Precision]) -> float:
    """The kind's slowest class's backward end under ``plan`` (the simulator's timeline)."""
    return max(line.backward_end_us for line in evaluator.propose_plan(kind, plan).timelines)


def _as_plan(ops: Sequence[int], precisions: Sequence[Precision]) -> dict[int, Precision]:
    return dict(zip(ops, precisions))
