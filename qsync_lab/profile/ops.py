"""Time every operator of a model per precision and phase: profile rows.

``profile_ops`` has two methods. ``in_step`` (the default) times each op inside real
training steps of the whole model, one run of steps per precision
(:mod:`qsync_lab.profile.in_step`): the times the simulator then adds up are those of a
step, cache misses and the autograd engine's scheduling included, so their sums follow a
measured step's forward and backward more closely than those of ops timed alone.
``isolated`` times one op at a time, as follows.

Both run on ``device``: the CPU (host clock), or a CUDA GPU (``device="cuda"``: a copy of
the model and the batch are moved there, the ops run the runtime's native CUDA path, and
every span is timed with CUDA events, :mod:`qsync_lab.profile.timing`; ``in_step`` rows
also carry ``host_us``, the host's time issuing the op, NaN elsewhere). The rows are named
after the device (:func:`~qsync_lab.profile.device.profile_device_name`: ``cpu``, or the
GPU's catalog kind such as ``H100-SXM5-80GB``), so a cost model attributes them to it.

How one op is measured alone (``method="isolated"``):

1. The model plus its loss is traced with torch.fx (the same trace and op order as
   :func:`qsync_lab.graph.trace_graph`) and run once on the example batch, capturing every
   op's real input values.
2. Per op and precision, a copy of the op runs as the runtime would run it under a plan
   giving it that precision or passing it on (:func:`~qsync_lab.quant.apply_op_precision_`,
   functional matmuls and linears through :func:`~qsync_lab.quant.low_precision_call`; an
   op the policy keeps in fp32 — pooling, a kind that refuses ``p`` — runs in fp32, and
   that one measurement serves every precision). Timed, with autograd recording as in
   training:

   * ``forward``: the op's call;
   * ``backward_input``: ``torch.autograd.grad`` of its output w.r.t. its float inputs
     that require grad in the model, with the op's parameters frozen during that
     forward, so no weight gradient is computed;
   * ``backward_weight``: the same w.r.t. its parameters, with the inputs detached.

   The fixed cost of one ``torch.autograd.grad`` call (measured on a one-element clone,
   :func:`autograd_call_overhead_us`) is subtracted from each backward sample: a training
   step enters the autograd engine once, not once per op.
3. Rows (both methods) are written only for the phases the simulator looks up (an op's
   phase with work, :func:`qsync_lab.costs.phase_work`), keyed by the op FQN and its shape
   key at the profiled batch size. A backward row's ``precision`` is the one the backward
   computes in (``int8`` ops: ``fp16``, :data:`qsync_lab.policy.DEFAULT_BACKWARD`); its
   ``plan_precision`` is the op's (``int8``), so it is never taken for an fp16 op's
   backward.

The profiling process keeps the host memory it frees (:mod:`qsync_lab.hostmem`), as the
training ranks do. Intra-op threads are whatever ``torch.get_num_threads()`` is; profile
with the threads a training rank will have (``torch.set_num_threads(1)`` for 2 DDP ranks
on 2 cores).

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

On a GPU, ``profile_ops(..., device="cuda")`` writes the same rows, named after the GPU.
"""

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from torch import fx, nn
from tqdm.auto import tqdm

from qsync_lab.costs import PROFILE_COLUMNS, op_work, phase_work, shape_key
from qsync_lab.errors import QSyncError
from qsync_lab.graph import symbolic_trace
from qsync_lab.hostmem import keep_freed_memory
from qsync_lab.policy import DEFAULT_BACKWARD, OpPrecision
from qsync_lab.precision import Precision
from qsync_lab.profile.device import profile_device, profile_device_name
from qsync_lab.profile.in_step import (InStepTimes, loss_root_on, profiled_graph,
                                       time_ops_in_steps)
from qsync_lab.profile.timing import median_time_us
from qsync_lab.quant import apply_op_precision_, function_runs_in, low_precision_call
from qsync_lab.quant.native import tf32_math

__all__ = ["METHODS", "autograd_call_overhead_us", "profile_ops"]

#: ``profile_ops`` methods
METHODS = ("isolated", "in_step")

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


def profile_ops(model: nn.Module, example_inputs, target: torch.Tensor,
                loss_fn: nn.Module, precisions: Sequence["Precision | str"], *,
                device: "torch.device | str" = "cpu", repeats: int = 10, warmup: int = 2,
                method: str = "in_step", progress: bool = True) -> pd.DataFrame:
    """Time every op of ``loss_fn(model(*example_inputs), target)`` (see the module docstring).

    Args:
        model: the model (not modified).
        example_inputs: one per-rank batch of inputs (a tuple, or a dict passed by name);
            its dim 0 is the profiled batch size.
        target: the batch's target.
        loss_fn: the loss module.
        precisions: forward precisions to profile each op in (``fp32`` first is usual).
        device: where the ops run, ``cpu`` or ``cuda`` (a copy of the model and the batch
            are moved there); the rows are named after it (module docstring).
        repeats, warmup: timed and untimed calls per measurement (``in_step``: training
            steps per precision).
        method: ``in_step`` (inside training steps of the whole model,
            :mod:`qsync_lab.profile.in_step`, from the hook trace where torch.fx cannot
            trace the model; an op's backward time is split between its two backward
            phases in proportion to their FLOPs) or ``isolated`` (each op alone, above;
            torch.fx only).
        progress: show a tqdm bar over the ops.

    Returns:
        Rows with the columns of :data:`qsync_lab.costs.PROFILE_COLUMNS`.
    """
    if method not in METHODS:
        raise QSyncError(f"unknown profiling method {method!r}; use one of {', '.join(METHODS)}")
    keep_freed_memory()
    device = profile_device(device)
    device_name = profile_device_name(device)
    precisions = [Precision.parse(p) for p in precisions]
    graph = profiled_graph(model, example_inputs, target, loss_fn)
    work = op_work(graph)
    batch = work.traced_batch_size
    phase_of = _PhaseWork(work)
    if method == "isolated":
        if graph.traced_with != "fx":
            raise QSyncError(f"torch.fx cannot trace {type(model).__name__}, and the isolated "
                             "method times ops captured from its fx trace; use method='in_step'")
        times = _isolated_times(model, example_inputs, target, loss_fn, work, repeats, warmup,
                                device)
    else:
        times = _in_step_times(model, example_inputs, target, loss_fn, phase_of, repeats,
                               warmup, device, graph.traced_with)
    rows = []
    bar = tqdm(total=len(work) * len(precisions), desc="profile ops", disable=not progress)
    for p in precisions:
        for i in range(len(work)):
            bar.update()
            phases = _phases_with_work(phase_of, i, p)
            if not phases:
                continue
            for phase, (time_us, host_us) in times(i, p, phases).items():
                q = p if phase == "forward" else DEFAULT_BACKWARD[p]
                flops, nbytes = phase_of(q, phase)
                rows.append({"device": device_name, "op": work.names[i], "kind": work.kinds[i],
                             "shape_key": shape_key(work, i, batch), "precision": str(q),
                             "plan_precision": str(p), "phase": phase, "batch_size": batch,
                             "numel": 0, "flops": float(flops[i]), "bytes": float(nbytes[i]),
                             "time_us": time_us, "repeats": repeats, "host_us": host_us})
    bar.close()
    return pd.DataFrame(rows, columns=list(PROFILE_COLUMNS))


def _isolated_times(model, example_inputs, target, loss_fn, work, repeats, warmup, device):
    """``times(i, precision, phases) -> {phase: (µs, nan)}`` measured one op at a time on
    ``device`` (no host times: each repeat is timed to its end)."""
    calls = _capture(model, example_inputs, target, loss_fn, device)
    if len(calls) != len(work):
        raise QSyncError(f"captured {len(calls)} op calls but the graph has {len(work)} ops; "
                         "the model's forward must be deterministic in structure")
    overhead_us = autograd_call_overhead_us(repeats=repeats, warmup=warmup, device=device)
    timed: dict[tuple[int, str], dict[str, float]] = {}

    def times(i: int, p: Precision, phases: list[str]) -> dict[str, tuple[float, float]]:
        op = _runnable(calls[i], p)
        key = (i, op.effective)  # an op that refuses p runs fp32: one measurement serves
        if key not in timed:
            with tf32_math(op.effective == "tf32"):  # as under a uniform plan's rank
                timed[key] = op.time_phases(phases, repeats=repeats, warmup=warmup,
                                            overhead_us=overhead_us, device=device)
        return {phase: (t, math.nan) for phase, t in timed[key].items() if phase in phases}

    return times


def _in_step_times(model, example_inputs, target, loss_fn, phase_of, repeats, warmup, device,
                   method):
    """``times(i, precision, phases) -> {phase: (µs, host µs)}`` measured inside training
    steps on ``device`` (traced by ``method``, as the graph was), one run of steps per
    precision; the backward split by the phases' FLOPs (host µs: NaN off CUDA)."""
    runs: dict[Precision, InStepTimes] = {}
    n = len(phase_of.work)

    def times(i: int, p: Precision, phases: list[str]) -> dict[str, tuple[float, float]]:
        if p not in runs:
            runs[p] = time_ops_in_steps(model, example_inputs, target, loss_fn, p,
                                        steps=repeats, warmup=warmup, device=device,
                                        method=method)
            if runs[p].ops != list(phase_of.work.names):
                raise QSyncError(f"a training step ran {len(runs[p].ops)} op calls but the "
                                 f"graph has {n} ops, or other ones")
        run = runs[p]
        out = ({"forward": (float(run.forward_us[i]), float(run.forward_host_us[i]))}
               if "forward" in phases else {})
        backward = [ph for ph in phases if ph != "forward"]
        q = DEFAULT_BACKWARD[p]
        flops = [phase_of(q, ph)[0][i] for ph in backward]
        total = sum(flops)
        for phase, f in zip(backward, flops):
            out[phase] = (float(run.backward_us[i]) * f / total,
                          float(run.backward_host_us[i]) * f / total)
        return out

    return times


def autograd_call_overhead_us(*, repeats: int = 20, warmup: int = 3,
                              device: "torch.device | str" = "cpu") -> float:
    """Median time of one ``torch.autograd.grad`` call through a one-element clone on
    ``device``: the fixed cost of entering the autograd engine, subtracted from backward
    measurements.

    Example::

        >>> autograd_call_overhead_us(repeats=3, warmup=1) > 0
        True
    """
    x = torch.zeros(1, requires_grad=True, device=device)
    y = x.clone()
    g = torch.ones(1, device=device)
    return median_time_us(lambda: torch.autograd.grad(y, x, g, retain_graph=True),
                          repeats=repeats, warmup=warmup, device=device)


def _capture(model, example_inputs, target, loss_fn, device) -> list[_Call]:
    root, example_inputs, target = loss_root_on(model, loss_fn, example_inputs, target, device)
    gm = symbolic_trace(root, (*example_inputs, target))
    capture = _Capture(gm)
    with torch.enable_grad():
        capture.run(*example_inputs, target)
    return capture.calls


class _PhaseWork:
    """``(flops, bytes)`` arrays of every op in one phase and precision, computed once."""

    def __init__(self, work) -> None:
        self.work = work
        self._cache: dict[tuple[Precision, str], tuple] = {}

    def __call__(self, precision: Precision, phase: str) -> tuple:
        key = (precision, phase)
        if key not in self._cache:
            self._cache[key] = phase_work(self.work, [precision] * len(self.work), phase,
                                          batch_size=self.work.traced_batch_size)
        return self._cache[key]


def _phases_with_work(phase_of: _PhaseWork, i: int, p: Precision) -> list[str]:
    """The phases of op ``i`` the simulator times (those with FLOPs or bytes)."""
    found = []
    for phase in ("forward", *_BACKWARD):
        flops, nbytes = phase_of(p if phase == "forward" else DEFAULT_BACKWARD[p], phase)
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
                    overhead_us: float, device: torch.device) -> dict[str, float]:
        out: dict[str, float] = {}
        with torch.enable_grad():
            if "forward" in phases:
                out["forward"] = median_time_us(lambda: self.fn(*self.args, **self.kwargs),
                                                repeats=repeats, warmup=warmup, device=device)
            for phase, wrt, frozen in (("backward_input", self.leaves, self.params),
                                       ("backward_weight", self.params, self.leaves)):
                if phase in phases and wrt:
                    out[phase] = max(self._backward_us(wrt, frozen, repeats, warmup, device)
                                     - overhead_us, 0.0)
        return out

    def _backward_us(self, wrt, frozen, repeats: int, warmup: int, device) -> float:
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
                              repeats=repeats, warmup=warmup, device=device)


def _runnable(call: _Call, precision: Precision) -> _Runnable:
    node = call.node
    args, kwargs = _fresh((call.args, call.kwargs))
    if node.op == "call_module":
        module = copy.deepcopy(node.graph.owning_module.get_submodule(node.target))
        effective = "fp32"
        if precision is not Precision.FP32 and apply_op_precision_(module, precision,
                                                                   node.target):
            effective = str(precision)
        params = [p for p in module.parameters() if p.requires_grad]
        return _Runnable(module, args, kwargs, params, effective)
    params = [t for t in _tensors((args, kwargs)) if isinstance(t, nn.Parameter)]
    name = node.target if node.op == "call_method" else node.target.__name__
    if precision is not Precision.FP32 and function_runs_in(name, precision):
        cfg = OpPrecision.parse(precision)
        return _Runnable(lambda *a, **k: low_precision_call(name, a, k, cfg, (0, 1)), args,
                         kwargs, params, str(precision))
    if node.op == "call_method":
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
