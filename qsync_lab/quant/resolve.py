"""The precisions a rank actually runs: a plan resolved by the simulator's policy.

The plan names the ops the allocator chose; the simulator's policy
(:func:`qsync_lab.simulate.resolve_precisions`) fills in the rest (activations and other
inheriting ops follow their producers). The runtime applies that resolution op by op to
every module it can set, so measured runs and predictions describe the same numerics;
functions such as ``add`` run in fp32 in the runtime.
"""

from collections.abc import Mapping

from torch import nn

from qsync_lab.costs import op_work
from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision
from qsync_lab.runtime.apply import apply_plan_
from qsync_lab.simulate.policy import resolve_precisions

__all__ = ["resolved_runtime_plan"]


def resolved_runtime_plan(model: nn.Module, graph, kind_plan: Mapping[str, str],
                          device) -> dict[str, str]:
    """Apply ``kind_plan`` as the simulator resolves it, in place; return what was applied.

    Every op whose resolved precision is not fp32 is set if the runtime can set it (a
    module of a plannable or boundary kind); the others keep running in fp32.

    Example::

        >>> import torch, torch.nn as nn
        >>> from qsync_lab.devices import load_catalog
        >>> from qsync_lab.graph import trace_graph
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> graph = trace_graph(model, torch.randn(3, 4))
        >>> resolved_runtime_plan(model, graph, {"0": "bf16"}, load_catalog().device("cpu"))
        {'0': 'bf16', '1': 'bf16'}
    """
    work = op_work(graph)
    assignment = resolve_precisions(work, dict(kind_plan), device)
    modules = dict(model.named_modules())
    applied = {}
    for name, precision in zip(work.names, assignment.precision):
        if precision is Precision.FP32 or name not in modules:
            continue
        try:
            apply_plan_(model, {name: precision}, device=device)
        except QSyncError:
            continue
        applied[name] = str(precision)
    return applied
