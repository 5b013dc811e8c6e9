"""Time every operator of a model in isolation, per precision and phase: profile rows.

How one op is measured (``profile_ops``):

1. The model plus its loss is traced with torch.fx (the same trace and op order as
   :func:`qsync_lab.graph.trace_graph`) and run once on the example batch, capturing every
   op's real input values.
2. Per op and precision, a copy of the op runs as the runtime would run it under a plan
   giving it that precision (``apply_plan_(copy, {"": p})``; an op the runtime cannot set —
   functions, pooling, a kind that refuses ``p`` — runs in fp32, and that one measurement
   serves every precision). Timed, with autograd recording as in training:

   * ``forward``: the op's call;
   * ``backward_input``: ``torch.autograd.grad`` of its output w.r.t. its float inputs
     that require grad in the model, with the op's parameters frozen during that
     forward, so no weight gradient is computed;
   * ``backward_weight``: the same w.r.t. its parameters, with the inputs detached.

   The fixed cost of one ``torch.autograd.grad`` call (measured on a one-element clone,
   :func:`autograd_call_overhead_us`) is subtracted from each backward sample: a training
   step enters the autograd engine once, not once per op.
3. Rows are written only for the phases the simulator looks up (an op's phase with work,
   :func:`qsync_lab.costs.phase_work`), keyed by the op FQN and its shape key at the
   profiled batch size. A backward row's ``precision`` is the one the backward computes
   in (``int8`` ops: ``fp16``, :mod:`qsync_lab.simulate.policy`); its ``plan_precision``
   is the op's (``int8``), so it is never taken for an fp16 op's backward.

Intra-op threads are whatever ``torch.get_num_threads()`` is; profile with the threads a
training rank will have (``torch.set_num_threads(1)`` for 2 DDP ranks on 2 cores).

Example::

    >>> import torch, torch.nn as nn
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    >>> rows = profile_ops(model, (torch.randn(4, 8),), torch.tensor([0, 1, 2, 0]),
    ...                    nn.CrossEntropyLoss(), ["fp32", "fp16"], repeats=2, warmup=0,
    ...                    progress=False)
    >>> sorted(set(zip(rows["op"], rows["phase"])))[:3]
    [('0', 'backward_weight'), ('0', 'forward'), ('1', 'backward_input')]
    >>> bool((rows["time_us"] >= 0).all()), rows["batch_size"].unique().tolist()
    (True, [4])
"""

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from torch import fx, nn
from tqdm.auto import tqdm

from qsync_lab.costs import PROFILE_COLUMNS, op_work, phase_work, shape_key
from qsync_lab.errors import QSyncError
from qsync_lab.graph import symbolic_trace, trace_graph
from qsync_lab.graph.opgraph import _with_loss
from qsync_lab.precision import Precision
from qsync_lab.profile.timing import median_time_us
from qsync_lab.runtime import apply_plan_
from qsync_lab.simulate.policy import backward_precision

__all__ = ["autograd_call_overhead_us", "profile_ops"]

_CALLS = ("call_module", "call_function", "call_method")
_BACKWARD = ("backward_input", "backward_weight")


@dataclass
class _Call:
    """One captured op call: the node and its argument values."""

    node: fx.Node
    args: tuple
    kwargs: dict


class _Capture(fx.Interpreter):
    """Runs the traced model and keeps each op call whose result holds a tensor."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.calls: list[_Call] = []

    def run_node(self, n: fx.Node):
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        out = getattr(self, n.op)(n.target, args, kwargs)
        if n.op in _CALLS and _tensors(out):
            self.calls.append(_Call(n, args, kwargs))
        return out


def profile_ops(model: nn.Module, example_inputs: tuple, target: torch.Tensor,
                loss_fn: nn.Module, precisions: Sequence["Precision | str"], *,
                device: str = "cpu", repeats: int = 10, warmup: int = 2,
                progress: bool = True) -> pd.DataFrame:
    """Time every op of ``loss_fn(model(*example_inputs), target)`` (see the module docstring).

    Args:
        model: the model (not modified).
        example_inputs: one per-rank batch of inputs; its dim 0 is the profiled batch size.
        target: the batch's target.
        loss_fn: the loss module.
        precisions: forward precisions to profile each op in (``fp32`` first is usual).
        device: the catalog device name written in the rows.
        repeats, warmup: timed and untimed calls per measurement.
        progress: show a tqdm bar over the ops.

    Returns:
        Rows with the columns of :data:`qsync_lab.costs.PROFILE_COLUMNS`.
    """
    precisions = [Precision.parse(p) for p in precisions]
    graph = trace_graph(model, example_inputs, target=target, loss_fn=loss_fn, method="fx")
    work = op_work(graph)
    calls = _capture(model, example_inputs, target, loss_fn)
    if len(calls) != len(work):
        raise QSyncError(f"captured {len(calls)} op calls but the graph has {len(work)} ops; "
                         "the model's forward must be deterministic in structure")
    batch = work.traced_batch_size
    overhead_us = autograd_call_overhead_us(repeats=repeats, warmup=warmup)
    timed: dict[tuple[int, str], dict[str, float]] = {}
    rows = []
    bar = tqdm(total=len(work) * len(precisions), desc="profile ops", disable=not progress)
    for i, call in enumerate(calls):
        for p in precisions:
            bar.update()
            phases = _phases_with_work(work, i, p, batch)
            if not phases:
                continue
            op = _runnable(call, p)
            key = (i, op.effective)
            if key not in timed:
                timed[key] = op.time_phases(phases, repeats=repeats, warmup=warmup,
                                            overhead_us=overhead_us)
            for phase, time_us in timed[key].items():
                if phase not in phases:
                    continue
                q = p if phase == "forward" else backward_precision(p)
                flops, nbytes = phase_work(work, [q] * len(work), phase, batch_size=batch)
                rows.append({"device": device, "op": work.names[i], "kind": work.kinds[i],
                             "shape_key": shape_key(work, i, batch), "precision": str(q),
                             "plan_precision": str(p), "phase": phase, "batch_size": batch, "numel": 0,
                             "flops": float(flops[i]), "bytes": float(nbytes[i]),
                             "time_us": time_us, "repeats": repeats})
    bar.close()
    return pd.DataFrame(rows, columns=list(PROFILE_COLUMNS))


def autograd_call_overhead_us(*, repeats: int = 20, warmup: int = 3) -> float:
    """Median time of one ``torch.autograd.grad`` call through a one-element clone: the
    fixed cost of entering the autograd engine, subtracted from backward measurements.

    Example::

        >>> autograd_call_overhead_us(repeats=3, warmup=1) > 0
        True
    """
    x = torch.zeros(1, requires_grad=True)
    y = x.clone()
    g = torch.ones(1)
    return median_time_us(lambda: torch.autograd.grad(y, x, g, retain_graph=True),
                          repeats=repeats, warmup=warmup)


def _capture(model, example_inputs, target, loss_fn) -> list[_Call]:
    root = _with_loss(model, loss_fn, len(example_inputs))
    gm = symbolic_trace(root)
    capture = _Capture(gm)
    with torch.enable_grad():
        capture.run(*example_inputs, target)
    return capture.calls


def _phases_with_work(work, i: int, p: Precision, batch: int) -> list[str]:
    """The phases of op ``i`` the simulator times (those with FLOPs or bytes)."""
    found = []
    for phase in ("forward", *_BACKWARD):
        q = p if phase == "forward" else backward_precision(p)
        flops, nbytes = phase_work(work, [q] * len(work), phase, batch_size=batch)
        if flops[i] > 0 or (phase == "forward" and nbytes[i] > 0):
            found.append(phase)
    return found


class _Runnable:
    """One op, ready to run on its captured inputs in one precision."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, params: list[torch.Tensor],
                 effective: str) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.params = params
        self.effective = effective
        self.leaves = [t for t in _tensors((args, kwargs)) if t.requires_grad
                       and not any(t is p for p in params)]

    def time_phases(self, phases: Sequence[str], *, repeats: int, warmup: int,
                    overhead_us: float) -> dict[str, float]:
        out: dict[str, float] = {}
        with torch.enable_grad():
            if "forward" in phases:
                out["forward"] = median_time_us(lambda: self.fn(*self.args, **self.kwargs),
                                                repeats=repeats, warmup=warmup)
            for phase, wrt, frozen in (("backward_input", self.leaves, self.params),
                                       ("backward_weight", self.params, self.leaves)):
                if phase in phases and wrt:
                    out[phase] = max(self._backward_us(wrt, frozen, repeats, warmup)
                                     - overhead_us, 0.0)
        return out

    def _backward_us(self, wrt, frozen, repeats: int, warmup: int) -> float:
        for t in frozen:
            t.requires_grad_(False)
        try:
            y = _tensors(self.fn(*self.args, **self.kwargs))[0]
        finally:
            for t in frozen:
                t.requires_grad_(True)
        if not y.requires_grad:
            return 0.0
        g = torch.randn_like(y)
        return median_time_us(lambda: torch.autograd.grad(y, wrt, g, retain_graph=True,
                                                          allow_unused=True),
                              repeats=repeats, warmup=warmup)


def _runnable(call: _Call, precision: Precision) -> _Runnable:
    node = call.node
    args, kwargs = _fresh((call.args, call.kwargs))
    if node.op == "call_module":
        module = copy.deepcopy(node.graph.owning_module.get_submodule(node.target))
        effective = "fp32"
        if precision is not Precision.FP32:
            try:
                apply_plan_(module, {"": precision})
                effective = str(precision)
            except QSyncError:
                pass
        params = [p for p in module.parameters() if p.requires_grad]
        return _Runnable(module, args, kwargs, params, effective)
    params = [t for t in _tensors((args, kwargs)) if isinstance(t, nn.Parameter)]
    if node.op == "call_method":
        name = node.target
        return _Runnable(lambda self, *a, **k: getattr(self, name)(*a, **k), args, kwargs,
                         params, "fp32")
    return _Runnable(node.target, args, kwargs, params, "fp32")


def _fresh(value):
    """Copy of captured arguments: tensors detached and cloned (leaves keep requires_grad),
    parameters kept, everything else as is."""
    def copy_one(x):
        if isinstance(x, nn.Parameter) or not isinstance(x, torch.Tensor):
            return x
        fresh = x.detach().clone()
        return fresh.requires_grad_(x.requires_grad and fresh.is_floating_point())
    return fx.node.map_aggregate(value, copy_one)


def _tensors(value) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda x: found.append(x) if isinstance(x, torch.Tensor)
                          else None)
    return found
