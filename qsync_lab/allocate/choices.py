"""Which ops of a device kind the allocator may plan, in which precisions, at what risk.

An op is a candidate when the policy lets a plan set it (:mod:`qsync_lab.policy`) and the
indicator scores it. Its choices are the precisions the policy lets its kind run on the
device (forward and backward) that the indicator scores, plus fp32 (risk 0), ordered from
the riskiest to fp32: the *ladder* the greedy climbs.

Example::

    >>> import pandas as pd
    >>> import torch, torch.nn as nn
    >>> from qsync_lab.costs import op_work
    >>> from qsync_lab.devices import load_catalog
    >>> from qsync_lab.graph import trace_graph
    >>> work = op_work(trace_graph(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)))
    >>> scores = pd.DataFrame({("fp16", "risk"): [0.1], ("int8", "risk"): [0.5]}, index=["0"])
    >>> c = op_choices(work, scores, load_catalog().device("T4"))
    >>> c.ops, [[str(p) for p in ladder] for ladder in c.ladders], c.op_risk[0]["int8"]
    ((0,), [['int8', 'fp16', 'fp32']], 0.5)
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd

from qsync_lab.costs import OpWork
from qsync_lab.devices import DeviceSpec
from qsync_lab.errors import QSyncError
from qsync_lab.policy import check_op_precision
from qsync_lab.precision import Precision

__all__ = ["OpChoices", "op_choices", "op_may_run"]


@dataclass(frozen=True, eq=False)
class OpChoices:
    """The candidate ops of one device kind.

    Attributes:
        device: the device kind.
        ops: candidate op indices, in graph order.
        ladders: per candidate, its precisions from the highest risk to fp32.
        op_risk: per candidate, precision -> the indicator's risk (fp32: 0).
    """

    device: DeviceSpec
    ops: tuple[int, ...]
    ladders: tuple[tuple[Precision, ...], ...]
    op_risk: tuple[Mapping[Precision, float], ...]

    def risk(self, plan: Mapping[int, Precision]) -> float:
        """Summed indicator of ``plan`` over the candidates (ops it leaves out: fp32)."""
        return float(sum(risk.get(plan.get(op, Precision.FP32), 0.0)
                         for op, risk in zip(self.ops, self.op_risk)))


def op_may_run(work: OpWork, index: int, precision: Precision, device: DeviceSpec) -> bool:
    """Whether the policy lets a plan run op ``index`` in ``precision`` on ``device``."""
    if work.plan_refusals[index]:
        return False
    try:
        check_op_precision(work.kinds[index], precision, device)
    except QSyncError:
        return False
    return True


def op_choices(work: OpWork, indicator: pd.DataFrame, device: DeviceSpec) -> OpChoices:
    """The candidates of ``device`` given the indicator's ``(precision, "risk")`` columns.

    Raises:
        QSyncError: the indicator has no ``risk`` column, or names an op the graph lacks.
    """
    columns = {Precision.parse(p): col for col in indicator.columns
               if isinstance(col, tuple) and len(col) == 2 and col[1] == "risk"
               for p in [col[0]]}
    if not columns:
        raise QSyncError("the indicator has no (precision, 'risk') columns; pass the "
                         "DataFrame qsync_lab.indicator.indicator returns")
    position = {name: i for i, name in enumerate(work.names)}
    unknown = [fqn for fqn in indicator.index if fqn not in position]
    if unknown:
        raise QSyncError(f"the indicator scores op {unknown[0]!r}, which the graph does not "
                         "have; compute it for this model")
    ops, ladders, risks = [], [], []
    for fqn in indicator.index:
        i = position[fqn]
        risk = {Precision.FP32: 0.0}
        for p, col in columns.items():
            value = float(indicator.at[fqn, col])
            if (p is not Precision.FP32 and math.isfinite(value)
                    and op_may_run(work, i, p, device)):
                risk[p] = max(value, 0.0)
        if len(risk) > 1:
            ops.append(i)
            ladders.append(tuple(sorted(risk, key=lambda p: (-risk[p], p.bits))))
            risks.append(risk)
    order = sorted(range(len(ops)), key=ops.__getitem__)
    return OpChoices(device, tuple(ops[k] for k in order), tuple(ladders[k] for k in order),
                     tuple(risks[k] for k in order))
