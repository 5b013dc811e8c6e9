"""Quantization-minimized allocation: which ops each device kind runs in low precision.

* :func:`allocate` — QSync's allocator (fastest feasible start, then recovery: a knapsack
  frontier bisected with the simulator and QSync's greedy); :class:`Allocator` keeps what
  it derives for re-planning under new constraints;
* :mod:`~qsync_lab.allocate.baselines` — uniform low precision, dynamic batching, and a
  joint search over precision and batch split;
* :mod:`~qsync_lab.allocate.exact` — the exact optimum of small instances;
* :func:`compare_strategies` — one table comparing them.

Example::

    >>> from qsync_lab.allocate import Constraints, allocate, compare_strategies
"""

from qsync_lab.allocate.baselines import (dynamic_batching, joint_batch_precision,
                                          uniform_low_precision)
from qsync_lab.allocate.chain import ChainCosts, chain_costs
from qsync_lab.allocate.choices import OpChoices, op_choices
from qsync_lab.allocate.compare import STRATEGIES, compare_strategies, plan_summary
from qsync_lab.constraints import Constraints
from qsync_lab.allocate.exact import (AdditiveInstance, OptimalityGap, exact_plan,
                                      linearized_instance, optimality_gap)
from qsync_lab.allocate.fastest import chain_viterbi, fastest_feasible_plan
from qsync_lab.allocate.frontier import RiskFrontier, risk_frontier, risk_frontiers
from qsync_lab.allocate.qsync import Allocation, Allocator, allocate, allocate_detailed
from qsync_lab.allocate.recover import RecoveryStats, greedy_recover, recover_plans

__all__ = [
    "STRATEGIES", "AdditiveInstance", "Allocation", "Allocator", "ChainCosts", "Constraints",
    "OpChoices", "OptimalityGap", "RecoveryStats", "RiskFrontier", "allocate",
    "allocate_detailed", "chain_costs", "chain_viterbi", "compare_strategies",
    "dynamic_batching", "exact_plan", "fastest_feasible_plan", "greedy_recover",
    "joint_batch_precision", "linearized_instance", "op_choices", "optimality_gap",
    "plan_summary", "recover_plans", "risk_frontier", "risk_frontiers",
    "uniform_low_precision",
]
