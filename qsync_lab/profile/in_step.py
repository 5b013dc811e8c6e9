"""Time every op inside real training steps of the whole model (the in-step profile).

An op timed alone runs cache-hot on inputs it has just read, with nothing around it. Inside
a training step its inputs come from the op before, its weights were just updated by the
optimizer, and the autograd engine runs its backward nodes among everyone else's. QSync
times ops that way too (uniform-precision runs under the profiler, one step's kernels per
op). :func:`time_ops_in_steps` does it without the profiler's cost per event:

1. a copy of the model with every op that takes ``precision`` set to it, as a plan or
   the follow rules would (:func:`~qsync_lab.quant.apply_op_precision_`; functional matmuls
   and linears through :func:`~qsync_lab.quant.low_precision_call`; ops the policy keeps
   in fp32 stay fp32), plus its loss;
2. ``warmup + steps`` training steps (``zero_grad``, forward, ``backward``, an SGD step)
   under the TF32 switches of a rank running the uniform plan (on for tf32, else off:
   :func:`~qsync_lab.quant.native.tf32_throughout`), each op's call timed: the forward run node by node when torch.fx can trace the model,
   else the model run as is, its op modules timed from a first forward pre-hook to a last
   forward hook and its functional calls through a :class:`~qsync_lab.graph.ScopedCalls`
   mode, as the hook tracer records them (``method``; one
   :class:`~qsync_lab.graph.TracingFallbackWarning` per model; an ``nn.MultiheadAttention``
   as its three ops, its in-projection and core timed as
   :func:`~qsync_lab.graph.attention.split_forward` calls them, its ``out_proj`` as a
   module). Either way the ops are named and ordered
   as :func:`qsync_lab.graph.trace_graph` traces them (:attr:`InStepTimes.ops`). Each
   autograd node an op creates (not ``AccumulateGrad``, whose hooks are DDP's and the
   framework's) gets a pre-hook and a hook that time it when the backward runs it. An
   op's backward time is the sum over its nodes;
3. per op, the median over the timed steps.

The model (a copy) and the batch run on ``device``, and the timer follows it
(:func:`~qsync_lab.timers.timer_for`): on the CPU each span is read off the host
clock as it ends (the host runs the op: its time is the host's). On CUDA the host only
issues the kernels, and an op costs a step two times, which eager PyTorch overlaps
(:mod:`qsync_lab.simulate.schedule` combines them): the device's, CUDA events recorded on
the stream around each op call and each autograd node (the hooks run on autograd's device
thread, the events on the same stream as the kernels), all resolved once after the
synchronise that ends the step; and the host's, the host clock inside those events
(``*_host_us``). Between two events the stream would also wait for the host to launch
the kernels, so each span is held first (:func:`~qsync_lab.profile.timing.hold_stream`)
for twice the host time the same span took in the first step, which runs unheld, plus
20 µs (:data:`HOLD_FACTOR`, :data:`HOLD_SLACK_US`; a span the first step did not have:
:data:`FIRST_HOLD_US`): the op's kernels queue behind the hold and its events time the
device alone. The sizes come from that unheld step, not the step before: a span that
waits for the device (a value read back to the host) would otherwise wait for its own
hold, and its hold would double every step. The holds put the device behind the host,
and once CUDA's launch queue (about a thousand launches) is full the host would wait for
the device inside a span, its host time then counting the device's: every
:data:`DRAIN_SPANS` spans the host waits for the device between two spans (an H200 profile
of BERT-base without this gave one op position 50 ms of host time in every step, and its
other ops up to three times the host time of an unqueued step).

Example::

    >>> import torch, torch.nn as nn
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    >>> t = time_ops_in_steps(model, (torch.randn(4, 8),), torch.tensor([0, 1, 2, 0]),
    ...                       nn.CrossEntropyLoss(), "bf16", steps=2, warmup=1)
    >>> t.effective, bool((t.forward_us > 0).all()), bool(np.isnan(t.forward_host_us).all())
    (['bf16', 'bf16', 'bf16', 'fp32'], True, True)
    >>> hooks = time_ops_in_steps(model, (torch.randn(4, 8),), torch.tensor([0, 1, 2, 0]),
    ...                           nn.CrossEntropyLoss(), "bf16", steps=1, method="hooks")
    >>> t.ops, t.traced_with, hooks.ops == t.ops, hooks.effective == t.effective
    (['0', '1', '2', 'loss'], 'fx', True, True)

On a GPU the same call with ``device="cuda"`` times the native low-precision kernels
(their casts and quantize steps included) with CUDA events, and the host issuing them.
"""

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import fx, nn

from qsync_lab.errors import QSyncError
from qsync_lab.graph import OpGraph, ScopedCalls, symbolic_trace, trace_graph
from qsync_lab.graph.attention import mha_in_projection, part_name, split_forward, splits
from qsync_lab.graph.fx_tracer import _scope
from qsync_lab.graph.kinds import is_leaf_module
from qsync_lab.graph.opgraph import _loss_root, _one_line, _strip_wrapper, warn_hooks_fallback
from qsync_lab.graph.records import OpNamer, OpRecord
from qsync_lab.policy import OpPrecision
from qsync_lab.precision import Precision
from qsync_lab.profile.device import profile_device, to_device
from qsync_lab.profile.timing import hold_stream
from qsync_lab.quant import apply_op_precision_, function_runs_in, low_precision_call
from qsync_lab.quant.native import tf32_math
from qsync_lab.timers import HostTimer, timer_for

__all__ = ["InStepTimes", "loss_root_on", "profiled_graph", "time_ops_in_steps"]

_CALLS = ("call_module", "call_function", "call_method")
_METHODS = ("auto", "fx", "hooks")
_NS_PER_US = 1e3
_LR = 1e-4  # small: the timed steps see (nearly) the same weights
#: a CUDA span is held for this many times the host time it took in the first step ...
HOLD_FACTOR = 2.0
#: ... plus this, µs (the events' own host time)
HOLD_SLACK_US = 20.0
#: the hold of a span the first step did not have, µs
FIRST_HOLD_US = 200.0
#: the host waits for the device before every this many spans: some 100 launches (the
#: spans' holds, events and kernels), a tenth of CUDA's launch queue
DRAIN_SPANS = 16


@dataclass(frozen=True)
class InStepTimes:
    """Median per-op times over the timed steps, in graph op order.

    Attributes:
        forward_us: each op's call.
        backward_us: each op's autograd nodes together (input and weight gradients).
        effective: the precision each op ran in (``fp32`` where it refused the one asked).
        forward_host_us, backward_host_us: on CUDA, the host's time issuing the same
            (NaN on the CPU, whose host runs the ops: their time is the host's).
        ops: each op's name, as the graph's (``graph.ops.index``).
        traced_with: ``"fx"`` or ``"hooks"``: how the ops were found and timed.
    """

    forward_us: np.ndarray
    backward_us: np.ndarray
    effective: list[str]
    forward_host_us: np.ndarray
    backward_host_us: np.ndarray
    ops: list[str]
    traced_with: str


def time_ops_in_steps(model: nn.Module, example_inputs, target: torch.Tensor,
                      loss_fn: nn.Module, precision: "Precision | str", *, steps: int = 10,
                      warmup: int = 3, device: "torch.device | str" = "cpu",
                      method: str = "auto") -> InStepTimes:
    """Time each op of ``loss_fn(model(*example_inputs), target)`` (``model(**example_inputs)``
    for a dict batch) inside training steps on ``device`` with
    every op in ``precision`` where it can be (see the module docstring); ``model`` is not
    modified. ``method``: ``"fx"``, ``"hooks"`` or ``"auto"`` (fx where torch.fx can trace
    the model, else hooks)."""
    if steps < 1 or warmup < 0:
        raise QSyncError(f"steps must be >= 1 and warmup >= 0, got {steps}, {warmup}")
    if method not in _METHODS:
        raise QSyncError(f"unknown tracing method {method!r}; choose auto, fx or hooks")
    device = profile_device(device)
    root, example_inputs, target = loss_root_on(model, loss_fn, example_inputs, target, device)
    precision = Precision.parse(precision)
    runner = _runner(model, root, (*example_inputs, target), precision, device, method)
    optimizer = torch.optim.SGD(root.parameters(), lr=_LR, momentum=0.9)
    samples, ops = [], None
    with tf32_math(precision is Precision.TF32):
        for step in range(warmup + steps):
            optimizer.zero_grad(set_to_none=True)
            runner.spans.reset()
            loss = runner.run(*example_inputs, target)
            loss.backward()
            optimizer.step()
            if ops is not None and runner.spans.ops != ops:
                raise QSyncError("the op calls differ between training steps; the model's "
                                 "forward must be deterministic in structure")
            ops = runner.spans.ops
            spans_ns = runner.spans.times_ns()  # on CUDA: synchronises the step once
            if step >= warmup:
                samples.append(spans_ns)
    forward, backward, forward_host, backward_host = np.median(samples, axis=0) / _NS_PER_US
    return InStepTimes(forward, backward, runner.spans.effective, forward_host, backward_host,
                       [_graph_name(name, model) for name in ops],
                       "fx" if isinstance(runner, _TimedRun) else "hooks")


def profiled_graph(model: nn.Module, example_inputs, target: torch.Tensor,
                   loss_fn: nn.Module) -> OpGraph:
    """The graph of ``loss_fn(model(...), target)`` as :func:`time_ops_in_steps` times it
    (``method="auto"``): traced with torch.fx, else with hooks and one
    :class:`~qsync_lab.graph.TracingFallbackWarning` per model.

    Example::

        >>> profiled_graph(nn.Linear(4, 2), torch.randn(3, 4), torch.tensor([0, 1, 1]),
        ...                nn.CrossEntropyLoss()).traced_with
        'fx'
    """
    try:
        return trace_graph(model, example_inputs, target=target, loss_fn=loss_fn, method="fx")
    except QSyncError as err:
        if err.__cause__ is None:  # not torch.fx's failure
            raise
        graph = trace_graph(model, example_inputs, target=target, loss_fn=loss_fn,
                            method="hooks")
        warn_hooks_fallback(model, err.__cause__, stacklevel=2)
        return graph


def loss_root_on(model: nn.Module, loss_fn: nn.Module, example_inputs, target,
                 device: "torch.device | str") -> tuple[nn.Module, tuple, object]:
    """``(root, inputs, target)`` on ``device``: ``root(*inputs, target)`` computes the loss
    of a copy of ``model`` (and of ``loss_fn``) for a tuple or dict batch."""
    root, example_inputs = _loss_root(copy.deepcopy(model), copy.deepcopy(loss_fn),
                                      example_inputs)
    return root.to(device), to_device(example_inputs, device), to_device(target, device)


def _runner(model: nn.Module, root: nn.Module, inputs: tuple, precision: Precision,
            device: torch.device, method: str) -> "_TimedRun | _HookTimedRun":
    """The fx runner of ``root`` (traced on ``inputs``) where ``method`` and torch.fx allow,
    else the hook runner."""
    if method != "hooks":
        try:
            gm = symbolic_trace(root, inputs)
        except Exception as err:  # fx raises many types for untraceable code
            if method == "fx":
                raise QSyncError(f"torch.fx cannot trace {type(model).__name__}: "
                                 f"{_one_line(err)}; use method='hooks'") from err
            warn_hooks_fallback(model, err, stacklevel=3)
        else:
            return _TimedRun(gm, precision, device)
    return _HookTimedRun(root, precision, device)


def _graph_name(name: str, model: nn.Module) -> str:
    """The graph's name of the op ``name`` of ``model``'s loss root."""
    return _strip_wrapper(OpRecord(name, "", ""), model).name


class _Spans:
    """The timed spans of one training step: each op's call and its autograd nodes, on
    the timer of ``device`` (on CUDA with the host's times and the holds: module
    docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._issued_ns: list[int] = []  # host ns of each span of the step, in begin order
        self._hold_ns: list[int] | None = None  # the first (unheld) step's: the hold sizes
        self.reset()

    def reset(self) -> None:
        """Forget the last step: its ops, their timed spans and the hooked nodes (the
        first step's host times size the holds of every later one)."""
        self.ops: list[str] = []
        self.effective: list[str] = []
        self.timer = timer_for(self.device)
        self.host = None if isinstance(self.timer, HostTimer) else HostTimer()  # CUDA
        if self._hold_ns is None and self._issued_ns:
            self._hold_ns = self._issued_ns
        self._issued_ns = []
        self._open = self._drained = 0  # spans begun and not ended; the last drain's span
        self._owned: set = set()
        self._started: dict = {}

    def times_ns(self) -> np.ndarray:
        """The last step's forward and backward time of each op, then their host times
        (NaN off CUDA), ns: four rows."""
        phases = ("forward", "backward")
        device = self.timer.totals_ns()
        rows = [[device.get((phase, i), 0) for i in range(len(self.ops))] for phase in phases]
        host = self.host.totals_ns() if self.host is not None else None
        rows += [[host.get((phase, i), 0) if host is not None else np.nan
                  for i in range(len(self.ops))] for phase in phases]
        return np.array(rows, float)

    def begin(self) -> tuple:
        """The marks opening a span: (device, host, span number); on CUDA the stream is
        held first (module docstring)."""
        if self.host is None:
            return self.timer.mark(), None, None
        index, sizes = len(self._issued_ns), self._hold_ns
        self._issued_ns.append(0)
        if index - self._drained >= DRAIN_SPANS and not self._open:  # outside any span
            torch.cuda.synchronize(self.device)
            self._drained = index
        if sizes is not None:
            hold_stream(self.device, HOLD_FACTOR * sizes[index] / _NS_PER_US + HOLD_SLACK_US
                        if index < len(sizes) else FIRST_HOLD_US)
        self._open += 1
        return self.timer.mark(), self.host.mark(), index

    def call_ends(self, begin: tuple, name: str, effective: str, output) -> None:
        """Close the call ``begin`` opened; if it returned a tensor it is the next op,
        ``name``, which ran in ``effective``, and its new autograd nodes are timed."""
        end = self._end(begin)
        tensors = _tensors(output)
        if not tensors:  # shape queries (size(), dim()) are not operators
            return
        index = len(self.ops)
        self._add(("forward", index), begin, end)
        self.ops.append(name)
        self.effective.append(effective)
        self._hook_new_nodes(tensors, index)

    def _end(self, begin: tuple) -> tuple:
        """The marks closing the span ``begin`` opened: (device, host)."""
        if self.host is None:
            return self.timer.mark(), None
        host_end = self.host.mark()
        self._issued_ns[begin[2]] = host_end - begin[1]
        self._open -= 1
        return self.timer.mark(), host_end

    def _add(self, key, begin: tuple, end: tuple) -> None:
        self.timer.add(key, begin[0], end[0])
        if self.host is not None:
            self.host.add(key, begin[1], end[1])

    def _hook_new_nodes(self, outputs: Sequence[torch.Tensor], index: int) -> None:
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or node in self._owned or type(node).__name__ == "AccumulateGrad":
                continue
            self._owned.add(node)
            node.register_prehook(self._pre_hook(node))
            node.register_hook(self._post_hook(node, index))
            stack.extend(fn for fn, _ in node.next_functions)

    def _pre_hook(self, node):
        def hook(grad_outputs):
            self._started[node] = self.begin()
        return hook

    def _post_hook(self, node, index: int):
        def hook(grad_inputs, grad_outputs):
            begin = self._started.pop(node)
            self._add(("backward", index), begin, self._end(begin))
        return hook


class _TimedRun(fx.Interpreter):
    """Runs the traced model node by node, every op that takes ``precision`` in it, timing
    each op's call and its autograd nodes; names the ops as
    :func:`~qsync_lab.graph.fx_tracer.trace_fx` does."""

    def __init__(self, gm: fx.GraphModule, precision: Precision, device: torch.device) -> None:
        super().__init__(gm)
        self.functional = OpPrecision.parse(precision)
        self.precision = str(precision)
        self.taken = _set_precision(gm, precision)
        self.spans = _Spans(device)

    def run(self, *args):
        self.namer = OpNamer()
        return super().run(*args)

    def run_node(self, n: fx.Node):
        if n.op not in _CALLS:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        begin = self.spans.begin()
        if n.op != "call_module" and n.name in self.taken:
            out = low_precision_call(_function_name(n), args, kwargs, self.functional, (0, 1))
        else:
            out = getattr(self, n.op)(n.target, args, kwargs)
        name = self._op_name(n) if _tensors(out) else ""
        self.spans.call_ends(begin, name, self.precision if n.name in self.taken else "fp32",
                             out)
        return out

    def _op_name(self, n: fx.Node) -> str:
        if n.op == "call_module":
            return self.namer.module(n.target)
        part = part_name(n.target, _scope(n))
        return self.namer.function(_scope(n), _function_name(n)) if part is None else \
            self.namer.module(part)


def _set_precision(gm: fx.GraphModule, precision: Precision) -> set[str]:
    """Set every op module of ``gm`` that takes ``precision`` to it; the names of those
    nodes and of the functional calls that take it (:class:`_TimedRun` runs them in it)."""
    taken = set()
    if precision is Precision.FP32:
        return taken
    for node in gm.graph.nodes:
        if node.op == "call_module":
            if apply_op_precision_(gm.get_submodule(node.target), precision, node.target):
                taken.add(node.name)
        elif node.op in _CALLS and function_runs_in(_function_name(node), precision):
            taken.add(node.name)
    return taken


def _function_name(node: fx.Node) -> str:
    return node.target if node.op == "call_method" else node.target.__name__


class _HookTimedRun(ScopedCalls):
    """Runs ``root`` as is, every op that takes ``precision`` in it, timing the ops the hook
    tracer (:mod:`qsync_lab.graph.hook_tracer`) records, named as it names them: each op
    module (not inside another) from a forward pre-hook that runs first to a forward hook
    that runs last (its precision's hooks inside), each functional call made outside op
    modules in :meth:`on_call`."""

    def __init__(self, root: nn.Module, precision: Precision, device: torch.device) -> None:
        super().__init__(root)
        self.precision = precision
        self.functional = OpPrecision.parse(precision)
        self.spans = _Spans(device)
        self._module_begin: tuple | None = None
        ops: list[str] = []  # the FQNs of the op modules not inside another one
        for fqn, module in root.named_modules():
            if module is root or not is_leaf_module(module):
                continue
            if splits(module):  # three ops: the two parts it calls, then its out_proj
                module.forward = functools.partial(
                    split_forward, module, call=functools.partial(self._attention_part, fqn))
                continue
            taken = False
            if not any(fqn.startswith(f"{op}.") for op in ops):
                ops.append(fqn)
                taken = (precision is not Precision.FP32
                         and apply_op_precision_(module, precision, fqn))
            # after the precision's hooks: the first pre-hook and the last hook
            module.register_forward_pre_hook(self._module_begins, prepend=True)
            module.register_forward_hook(
                lambda m, args, kwargs, out, fqn=fqn, taken=taken:
                    self._module_ends(fqn, taken, out), with_kwargs=True, always_call=True)

    def run(self, *args):
        with self:
            return self.model(*args)

    def on_call(self, name, fn_name, func, args, kwargs):
        taken = self.precision is not Precision.FP32 and function_runs_in(fn_name,
                                                                          self.precision)
        begin = self.spans.begin()
        if taken:
            out = low_precision_call(fn_name, args, kwargs, self.functional, (0, 1))
        else:
            out = func(*args, **kwargs)
        self.spans.call_ends(begin, name, str(self.precision) if taken else "fp32", out)
        return out

    def is_op_module(self, module: nn.Module) -> bool:
        return super().is_op_module(module) and not splits(module)

    def _attention_part(self, fqn: str, fn, *args):
        """Time the in-projection or the core of the attention module ``fqn``
        (:func:`~qsync_lab.graph.attention.split_forward`'s ``call``)."""
        taken = (fn is mha_in_projection and self.precision is not Precision.FP32
                 and function_runs_in(fn.__name__, self.precision))
        name = self.namer.module(part_name(fn, fqn))
        begin = self.spans.begin()
        self.leaf_depth += 1  # its torch calls are the op's, not ops
        try:
            out = (low_precision_call(fn.__name__, args, {}, self.functional, (0, 1)) if taken
                   else fn(*args))
        finally:
            self.leaf_depth -= 1
        self.spans.call_ends(begin, name, str(self.precision) if taken else "fp32", out)
        return out

    def _module_begins(self, module: nn.Module, args) -> None:
        if self.leaf_depth == 0:  # not inside another op module
            self._module_begin = self.spans.begin()
        self.leaf_depth += 1  # the precision's own hooks (casts) are the op's, not ops

    def _module_ends(self, fqn: str, taken: bool, output) -> None:
        self.leaf_depth -= 1
        if self.leaf_depth == 0:
            begin, self._module_begin = self._module_begin, None
            self.spans.call_ends(begin, self.namer.module(fqn),
                                 str(self.precision) if taken else "fp32", output)


def _tensors(value) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda x: found.append(x) if isinstance(x, torch.Tensor)
                          else None)
    return found
