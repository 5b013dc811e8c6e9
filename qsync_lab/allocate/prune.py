"""Never worse than full precision: give fp32 back to every op whose low precision buys nothing.

After the recovery, per allocated device kind: the kind's all-fp32 plan replaces its plan
when the predicted iteration is no slower and fp32 fits the memory budget; otherwise each
low-precision op, the riskiest first, goes back to fp32 when the iteration does not get
slower and memory still fits, until a full pass changes nothing. So no kind as a whole and
no single op runs in low precision without the prediction saying it pays, in time or in
memory.

Works on any evaluator with ``propose(kind, {op: precision})``, ``accept(proposal)`` and
``iteration_us`` (:class:`~qsync_lab.simulate.PlanEvaluator`, the additive instances of
:mod:`qsync_lab.allocate.exact`).

Example::

    >>> from qsync_lab.allocate.exact import AdditiveInstance
    >>> inst = AdditiveInstance.random(ops=4, seed=0)
    >>> evaluator = inst.evaluator()            # holds the fastest plan
    >>> plan = [evaluator.plan[k] for k in range(4)]
    >>> prune_plans(evaluator, {"instance": inst.choices}, {"instance": plan},
    ...             {"instance": inst.budget_bytes})   # each low precision saves time here
    0
"""

from collections.abc import Mapping

from qsync_lab.allocate.choices import OpChoices
from qsync_lab.precision import Precision

__all__ = ["prune_plans"]


def prune_plans(evaluator, choices: Mapping[str, OpChoices],
                plans: Mapping[str, list[Precision]],
                budgets_bytes: Mapping[str, float]) -> int:
    """Raise to fp32 what does not pay (module docstring), in place; returns how many ops."""
    raised = 0
    for kind, c in choices.items():
        plan = plans[kind]
        low = [k for k, p in enumerate(plan) if p is not Precision.FP32]
        if not low:
            continue
        full = evaluator.propose(kind, {c.ops[k]: Precision.FP32 for k in low})
        if _no_worse(evaluator, full, budgets_bytes[kind]):
            evaluator.accept(full)
            plan[:] = [Precision.FP32] * len(plan)
            raised += len(low)
            continue
        changed = True
        while changed:
            changed = False
            low = sorted((k for k, p in enumerate(plan) if p is not Precision.FP32),
                         key=lambda k: -c.op_risk[k][plan[k]])
            for k in low:
                proposal = evaluator.propose(kind, {c.ops[k]: Precision.FP32})
                if _no_worse(evaluator, proposal, budgets_bytes[kind]):
                    evaluator.accept(proposal)
                    plan[k] = Precision.FP32
                    raised += 1
                    changed = True
    return raised


def _no_worse(evaluator, proposal, budget_bytes: float) -> bool:
    return (proposal.iteration_us <= evaluator.iteration_us
            and proposal.tensor_peak_bytes <= budget_bytes)
