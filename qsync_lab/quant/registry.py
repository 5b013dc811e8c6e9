"""How a config is applied to a module of each plannable op kind.

The policy (:mod:`qsync_lab.policy`) decides which kinds, precisions and modules a plan may
set; this module only carries its decisions out:

* kinds whose low precision replaces the forward (linear, conv, matmul, embedding): the
  module's class is switched in place to its low-precision class
  (:func:`~qsync_lab.quant.modules.low_precision_class`), and back for fp32;
* the other plannable kinds (norms): :class:`~qsync_lab.quant.modules.PrecisionBoundary`
  hooks round their inputs and outputs. The runtime uses the same hooks on activation
  modules that inherit a 16-bit precision from their producers.

Example::

    >>> from torch import nn
    >>> from qsync_lab.policy import OpPrecision
    >>> layer = nn.LayerNorm(4)
    >>> handler_for("layer_norm").apply(layer, OpPrecision.parse("bf16"), "ln")
    >>> str(current_precision(layer))
    'bf16/bf16 nearest tensor'
"""

import zlib
from abc import ABC, abstractmethod

from torch import nn

from qsync_lab.policy import PLANNABLE_KINDS, OpPrecision
from qsync_lab.policy.evidence import linear_layout
from qsync_lab.quant.modules import LowPrecisionOp, PrecisionBoundary, low_precision_class

__all__ = ["BoundaryHandler", "OpHandler", "SwapHandler", "current_precision", "handler_for"]

FP32_OP = OpPrecision.parse("fp32")


class OpHandler(ABC):
    """Applies an :class:`~qsync_lab.policy.OpPrecision` to a module of one op kind."""

    @abstractmethod
    def apply(self, module: nn.Module, cfg: OpPrecision, fqn: str) -> None:
        """Make ``module`` run in ``cfg`` (fp32: restore the plain module)."""


class SwapHandler(OpHandler):
    """Switches a module between its own class and its low-precision class."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def apply(self, module, cfg, fqn):
        if isinstance(module, LowPrecisionOp):
            module.__class__ = module.op_float_class
            for name in ("op_precision", "op_seed", "op_calls"):
                delattr(module, name)
        if cfg.is_fp32:
            return
        transposed = self.kind == "linear" and linear_layout(module) == "transposed"
        module.__class__ = low_precision_class(type(module), self.kind, transposed=transposed)
        module.op_precision = cfg
        module.op_seed = zlib.crc32(fqn.encode())
        module.op_calls = 0


class BoundaryHandler(OpHandler):
    """fp16/bf16 I/O through :class:`PrecisionBoundary` hooks (fp32 math inside a norm)."""

    def __init__(self, *, fp32_inside: bool = True) -> None:
        self.fp32_inside = fp32_inside

    def apply(self, module, cfg, fqn):
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, h in hooks.items()
                        if isinstance(getattr(h, "__self__", None), PrecisionBoundary)]:
                del hooks[key]
        if cfg.is_fp32:
            if hasattr(module, "op_precision"):
                del module.op_precision
            return
        boundary = PrecisionBoundary(cfg, fp32_inside=self.fp32_inside)
        module.register_forward_pre_hook(boundary.before)
        module.register_forward_hook(boundary.after)
        module.op_precision = cfg


_HANDLERS: dict[str, OpHandler] = {
    kind: SwapHandler(kind) if rule.replaces_forward
    else BoundaryHandler(fp32_inside=rule.fp32_inside)
    for kind, rule in PLANNABLE_KINDS.items()}
# followers of 16-bit ops (runtime only)
_HANDLERS["activation"] = BoundaryHandler(fp32_inside=False)


def handler_for(kind: str | None) -> OpHandler | None:
    """The handler of a plannable op kind (or of activations), else None."""
    return _HANDLERS.get(kind)


def current_precision(module: nn.Module) -> OpPrecision:
    """The config a module runs in (fp32 when no plan changed it)."""
    return getattr(module, "op_precision", FP32_OP)
