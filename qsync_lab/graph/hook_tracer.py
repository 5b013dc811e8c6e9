"""Record operators by running the model once: module hooks + a TorchFunctionMode.

Used when torch.fx cannot trace a model (data-dependent control flow, unsupported
Python). Op modules are recorded by forward hooks; functional calls made outside op
modules (``x + y``, ``torch.matmul``, ``x.view(...)``) by a ``TorchFunctionMode``. Data
edges come from tensor identity. Names follow the fx tracer's scheme, so a plan keyed by
op FQN fits either trace.

Example::

    >>> import torch, torch.nn as nn
    >>> recs = trace_hooks(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), (torch.randn(2, 4),))
    >>> [(r.name, r.kind) for r in recs]
    [('0', 'linear'), ('1', 'activation')]
"""

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from qsync_lab.graph.kinds import function_kind, is_leaf_module, module_kind
from qsync_lab.graph.records import OpNamer, OpRecord, TensorMeta


class _Recorder(TorchFunctionMode):
    """Collects records while the model runs; one instance per trace."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.records: list[OpRecord] = []
        self.namer = OpNamer()
        self.scope: list[str] = []
        self.leaf_depth = 0  # > 0 while inside an op module: its internals are not ops
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        self.producer: dict[int, str] = {}
        self.keep_alive: list[torch.Tensor] = []  # ids stay unique while we map them

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.leaf_depth == 0:
            fn_name = getattr(func, "__name__", str(func))
            name = self.namer.function(self.scope[-1] if self.scope else "", fn_name)
            self._add(OpRecord(name, function_kind(fn_name), fn_name), (args, kwargs), out)
        return out

    def enter_module(self, fqn: str, module: nn.Module) -> None:
        self.scope.append(fqn)
        if is_leaf_module(module):
            self.leaf_depth += 1

    def exit_module(self, fqn: str, module: nn.Module, inputs, output) -> None:
        self.scope.pop()
        if not is_leaf_module(module):
            return
        self.leaf_depth -= 1
        if self.leaf_depth == 0:
            rec = OpRecord(self.namer.module(fqn), module_kind(module) or "other",
                           f"{type(module).__module__}.{type(module).__name__}")
            self._add(rec, inputs, output, skip_params=True)
            rec.params = [(f"{fqn}.{n}" if fqn else n, TensorMeta.of(p))
                          for n, p in module.named_parameters()]

    def _add(self, rec: OpRecord, inputs, output, skip_params: bool = False) -> None:
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        if not outputs:  # shape queries (size(), dim()) are not operators
            return
        for t in tree_flatten(inputs)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            if id(t) in self.param_names:
                if not skip_params:
                    rec.params.append((self.param_names[id(t)], TensorMeta.of(t)))
                continue
            rec.inputs.append(TensorMeta.of(t))
            rec.input_ops.append(self.producer.get(id(t)))
        rec.outputs = [TensorMeta.of(t) for t in outputs]
        for t in outputs:
            self.producer[id(t)] = rec.name
            self.keep_alive.append(t)
        self.records.append(rec)


def trace_hooks(model: nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> list[OpRecord]:
    """Run ``model`` once on ``example_inputs`` and return one record per operator call."""
    recorder = _Recorder(model)
    handles = []
    for fqn, module in model.named_modules():
        if module is model:
            continue
        handles.append(module.register_forward_pre_hook(
            lambda m, args, fqn=fqn: recorder.enter_module(fqn, m)))
        handles.append(module.register_forward_hook(
            lambda m, args, out, fqn=fqn: recorder.exit_module(fqn, m, args, out)))
    try:
        with recorder:
            model(*example_inputs)
    finally:
        for handle in handles:
            handle.remove()
    return recorder.records
