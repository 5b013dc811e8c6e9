"""Record operators by running the model once: module hooks + a TorchFunctionMode.

Used when torch.fx cannot trace a model, not even on its example inputs (a Python object
handed to an op, unsupported Python). Op modules are recorded by forward hooks (a multi-head attention call as its three
ops, :mod:`qsync_lab.graph.attention`); functional calls made outside op
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
from torch.utils._pytree import tree_flatten

from qsync_lab.graph import attention
from qsync_lab.graph.calls import ScopedCalls
from qsync_lab.graph.flop_count import counted_forward_flops
from qsync_lab.graph.kinds import COUNTED_KINDS, function_record, is_leaf_module, module_record
from qsync_lab.graph.records import OpRecord, TensorMeta


class _Recorder(ScopedCalls):
    """Collects records while the model runs; one instance per trace."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.records: list[OpRecord] = []
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        self.producer: dict[int, str] = {}
        self.keep_alive: list[torch.Tensor] = []  # ids stay unique while we map them

    def on_call(self, name, fn_name, func, args, kwargs):
        out = func(*args, **kwargs)
        rec = function_record(name, fn_name)
        if self._add(rec, (args, kwargs), out) and rec.kind in COUNTED_KINDS:
            rec.counted_fwd_flops = counted_forward_flops(func, args, kwargs)
        return out

    def exit_module(self, fqn: str, module: nn.Module, inputs, kwargs, output) -> None:
        super().exit_module(fqn, module, inputs, kwargs, output)
        if self.leaf_depth == 0 and attention.splits(module):
            self._add_attention(fqn, module, inputs, kwargs, output)
        elif is_leaf_module(module) and self.leaf_depth == 0:
            rec = module_record(self.namer.module(fqn), module)
            if self._add(rec, inputs, output, skip_params=True) and rec.kind in COUNTED_KINDS:
                self.leaf_depth += 1  # the meta call below is no operator of the model
                try:
                    rec.counted_fwd_flops = counted_forward_flops(None, inputs, {},
                                                                  module=module)
                finally:
                    self.leaf_depth -= 1
            rec.params = [(f"{fqn}.{n}" if fqn else n, TensorMeta.of(p))
                          for n, p in module.named_parameters()]

    def _add_attention(self, fqn: str, module: nn.Module, inputs, kwargs, output) -> None:
        """The three records of a multi-head attention call (:mod:`qsync_lab.graph.attention`)."""
        self.leaf_depth += 1  # the meta calls below are no operators of the model
        try:
            records = attention.split_records(self.namer, fqn, module, inputs, kwargs,
                                              lambda t: self.producer.get(id(t)))
        finally:
            self.leaf_depth -= 1
        out, weights = output
        for rec, made in zip(records, (None, weights, out)):
            if isinstance(made, torch.Tensor):
                self.producer[id(made)] = rec.name
                self.keep_alive.append(made)
        self.records.extend(records)

    def _add(self, rec: OpRecord, inputs, output, skip_params: bool = False) -> bool:
        """Record ``rec`` if the call returned a tensor (False for shape queries)."""
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        if not outputs:  # shape queries (size(), dim()) are not operators
            return False
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
        return True


def trace_hooks(model: nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> list[OpRecord]:
    """Run ``model`` once on ``example_inputs`` and return one record per operator call."""
    recorder = _Recorder(model)
    try:
        with recorder:
            model(*example_inputs)
    finally:
        recorder.detach()
    return recorder.records
