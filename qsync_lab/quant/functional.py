"""Functional operators in low precision: ``torch.matmul``, ``@``, ``mm``, ``bmm``, ``F.linear``
(and the in-projection of a multi-head attention traced by torch.fx,
:func:`~qsync_lab.graph.attention.mha_in_projection`).

A functional call has no module to swap, so a plan names it by its op FQN (``scope.matmul``,
``scope.matmul_1``; :mod:`qsync_lab.graph.calls`) and :class:`FunctionalPrecisions`, a mode
entered around every forward of the model, runs each planned call through the same
autograd functions as the modules (:func:`low_precision_call`). The attention products of
a hand-written transformer (``q @ k.transpose(-1, -2)``) are planned this way.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.quant import apply_plan_, describe_precisions
    >>> class Scores(nn.Module):
    ...     def forward(self, x):
    ...         return x @ x.transpose(-1, -2)
    >>> model = nn.Sequential(nn.Linear(4, 4), Scores())
    >>> apply_plan_(model, {"1.matmul": "fp16"})
    >>> describe_precisions(model).loc["1.matmul", ["kind", "forward"]].tolist()
    ['matmul', 'fp16']
    >>> model(torch.randn(3, 4)).shape
    torch.Size([3, 3])
"""

import zlib

from torch import nn

from qsync_lab.errors import QSyncError
from qsync_lab.graph.attention import IN_PROJECTION_FUNCTION, in_projection
from qsync_lab.graph.calls import ScopedCalls
from qsync_lab.graph.records import op_name_of
from qsync_lab.policy import OpPrecision
from qsync_lab.quant.functions import bilinear
from qsync_lab.quant.gemm import LinearKernel, MatMulKernel
from qsync_lab.quant.attention import projection_linear
from qsync_lab.quant.modules import stream_seeds
from qsync_lab.quant.native import fp32_inputs

__all__ = ["FunctionalPrecisions", "functional_precisions", "low_precision_call"]

_ATTRIBUTE = "qsync_functional_precisions"


def low_precision_call(fn_name: str, args: tuple, kwargs: dict, cfg: OpPrecision,
                       seeds: tuple[int, int]):
    """``fn_name(*args, **kwargs)`` (a functional matmul or linear) computed in ``cfg``."""
    op = op_name_of(fn_name)
    if op in ("matmul", "mm", "bmm") and len(args) == 2 and not kwargs:
        a, b = (args[1], args[0]) if fn_name == "__rmatmul__" else args
        return bilinear(MatMulKernel(), a, b, None, cfg, seeds)
    if op == IN_PROJECTION_FUNCTION and not kwargs:  # a multi-head attention's in-projection
        sources, pattern, weights, bias, batch_first = args
        return in_projection(sources, pattern, weights, bias, batch_first,
                             projection_linear(cfg, seeds * 3))
    if op == "linear" and 2 <= len(args) + len(kwargs) <= 3 and set(kwargs) <= {"bias"}:
        x, weight, *rest = args
        return bilinear(LinearKernel(), x, weight, rest[0] if rest else kwargs.get("bias"),
                        cfg, seeds)
    raise QSyncError(f"cannot run {fn_name} with {len(args)} arguments and keywords "
                     f"{sorted(kwargs)} in low precision; call it as fn(a, b) (linear: "
                     "fn(x, weight, bias)) or leave it out of the plan")


class FunctionalPrecisions(ScopedCalls):
    """Runs the planned functional calls of a model in their configs, at every forward.

    Attributes:
        configs: op FQN -> config of the planned calls.
        calls: op FQN -> how many times it ran (its stochastic-rounding stream).
        fp32_calls: op FQNs of fp32 calls that a native fp16/bf16 op may feed: their
            16-bit tensor arguments are widened to fp32.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.configs: dict[str, OpPrecision] = {}
        self.calls: dict[str, int] = {}
        self.fp32_calls: set[str] = set()  # fp32 calls whose 16-bit operands are widened
        self._seen: set[str] = set()
        self._checked = False
        self.attach()

    def set(self, fqn: str, cfg: OpPrecision) -> None:
        """Run ``fqn`` in ``cfg`` from the next forward on (fp32: leave it alone)."""
        if cfg.is_fp32:
            self.configs.pop(fqn, None)
            self.calls.pop(fqn, None)
        else:
            self.configs[fqn] = cfg
            self.calls.setdefault(fqn, 0)
        self._checked = False

    def on_call(self, name, fn_name, func, args, kwargs):
        cfg = self.configs.get(name)
        if cfg is None:
            if name in self.fp32_calls:
                args = fp32_inputs(None, args)
            return func(*args, **kwargs)
        self._seen.add(name)
        call = self.calls[name]
        self.calls[name] = call + 1
        seeds = stream_seeds(zlib.crc32(name.encode()), call, 2)
        return low_precision_call(fn_name, args, kwargs, cfg, seeds)

    def _forward_begins(self, model, args) -> None:
        self._seen = set()
        super()._forward_begins(model, args)

    def _forward_ends(self, model, args, output) -> None:
        super()._forward_ends(model, args, output)
        if self._checked:
            return
        self._checked = True
        missing = sorted(set(self.configs) - self._seen)
        if missing:
            raise QSyncError(f"the plan sets functional op {missing[0]!r}, which the model's "
                             "forward did not call; name the op as qsync_lab.graph.trace_graph "
                             "does (graph.ops.index)")


def functional_precisions(model: nn.Module, *, create: bool = False) -> FunctionalPrecisions | None:
    """The model's :class:`FunctionalPrecisions` (made and attached with ``create``)."""
    current = model.__dict__.get(_ATTRIBUTE)
    if current is None and create:
        current = FunctionalPrecisions(model)
        model.__dict__[_ATTRIBUTE] = current
    return current
