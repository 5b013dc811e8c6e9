"""Which op kinds a plan can address, what precisions each takes, and how it is applied.

One handler per op kind (``qsync_lab.graph.kinds``), registered with
:func:`register_op_handler`:

* GEMM kinds (linear, conv2d, matmul, embedding) run in any precision: their module's
  class is switched in place to the low-precision subclass (``modules.py``), and back to
  the torch class for fp32.
* Norms, softmax and activations run in fp32, fp16 or bf16 only (QSync keeps them at 16-bit
  floats or wider): :class:`~qsync_lab.runtime.modules.PrecisionBoundary` hooks round
  their inputs and outputs.
* Every other kind (pool, dropout, view, loss, ...) is not addressable.

tf32 only changes GEMM inputs, so for embedding and the boundary kinds it means fp32.

Example::

    >>> from qsync_lab.runtime.registry import handler_for
    >>> sorted(map(str, handler_for("layer_norm").precisions))
    ['bf16', 'fp16', 'fp32']
"""

import zlib
from abc import ABC, abstractmethod
from dataclasses import replace

from torch import nn

from qsync_lab.models.layers import MatMul
from qsync_lab.precision import Precision
from qsync_lab.runtime.config import OpPrecision
from qsync_lab.runtime.modules import (
    LowPrecisionOp,
    PrecisionBoundary,
    QConv2d,
    QEmbedding,
    QLinear,
    QMatMul,
)

FP32_OP = OpPrecision(Precision.FP32)


def _tf32_as_fp32(cfg: OpPrecision) -> OpPrecision:
    """The same config with tf32 (in either pass) replaced by fp32."""
    def fix(p):
        return Precision.FP32 if p is Precision.TF32 else p

    return replace(cfg, forward=fix(cfg.forward), backward=fix(cfg.backward_precision))


class OpHandler(ABC):
    """Applies an :class:`OpPrecision` to the modules of one op kind.

    Attributes:
        precisions: the precisions its ops may run in (forward and backward).
    """

    precisions: frozenset[Precision]

    def normalize(self, cfg: OpPrecision) -> OpPrecision:
        """The config as this kind runs it (e.g. tf32 read as fp32); identity by default."""
        return cfg

    def unsupported(self, module: nn.Module) -> str | None:
        """Why this module cannot take a low precision, or None when it can."""
        return None

    @abstractmethod
    def apply(self, module: nn.Module, cfg: OpPrecision, fqn: str) -> None:
        """Make ``module`` run in ``cfg`` (fp32: restore the plain module)."""


class SwapHandler(OpHandler):
    """Switches a module between its torch class and its low-precision subclass."""

    def __init__(self, float_cls: type[nn.Module], low_cls: type[LowPrecisionOp],
                 precisions: frozenset[Precision] = frozenset(Precision)) -> None:
        self.float_cls, self.low_cls, self.precisions = float_cls, low_cls, precisions

    def unsupported(self, module):
        if type(module) not in (self.float_cls, self.low_cls):
            return (f"its type {type(module).__name__} has no low-precision version "
                    f"(only {self.float_cls.__name__} has)")
        return None

    def apply(self, module, cfg, fqn):
        if cfg.is_fp32:
            if isinstance(module, self.low_cls):
                module.__class__ = self.float_cls
                for name in ("op_precision", "op_seed", "op_calls"):
                    delattr(module, name)
            return
        module.__class__ = self.low_cls
        module.op_precision = cfg
        module.op_seed = zlib.crc32(fqn.encode())
        module.op_calls = 0


class EmbeddingHandler(SwapHandler):
    """Embeddings: no tf32 (no GEMM), and no max_norm or sparse gradients."""

    def __init__(self) -> None:
        super().__init__(nn.Embedding, QEmbedding, frozenset(Precision) - {Precision.TF32})

    def normalize(self, cfg):
        return _tf32_as_fp32(cfg)

    def unsupported(self, module):
        if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.sparse):
            return "it uses max_norm or sparse gradients, which low-precision embeddings do not"
        return super().unsupported(module)


class BoundaryHandler(OpHandler):
    """Norms, softmax, activations: fp16/bf16 I/O through :class:`PrecisionBoundary` hooks."""

    precisions = frozenset({Precision.FP32, Precision.FP16, Precision.BF16})

    def normalize(self, cfg):
        return _tf32_as_fp32(cfg)

    def apply(self, module, cfg, fqn):
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, h in hooks.items()
                        if isinstance(getattr(h, "__self__", None), PrecisionBoundary)]:
                del hooks[key]
        if cfg.is_fp32:
            if hasattr(module, "op_precision"):
                del module.op_precision
            return
        boundary = PrecisionBoundary(cfg)
        module.register_forward_pre_hook(boundary.before)
        module.register_forward_hook(boundary.after)
        module.op_precision = cfg


_HANDLERS: dict[str, OpHandler] = {}


def register_op_handler(kind: str, handler: OpHandler) -> None:
    """Make ops of ``kind`` addressable by plans, applied by ``handler`` (replaces any)."""
    _HANDLERS[kind] = handler


def handler_for(kind: str | None) -> OpHandler | None:
    """The handler of an op kind, or None when plans cannot address that kind."""
    return _HANDLERS.get(kind)


def addressable_kinds() -> tuple[str, ...]:
    """The op kinds a plan can address, sorted."""
    return tuple(sorted(_HANDLERS))


def current_precision(module: nn.Module) -> OpPrecision:
    """The config a module runs in (fp32 when no plan changed it)."""
    return getattr(module, "op_precision", FP32_OP)


register_op_handler("linear", SwapHandler(nn.Linear, QLinear))
register_op_handler("conv2d", SwapHandler(nn.Conv2d, QConv2d))
register_op_handler("matmul", SwapHandler(MatMul, QMatMul))
register_op_handler("embedding", EmbeddingHandler())
for _kind in ("batch_norm", "layer_norm", "group_norm", "rms_norm", "softmax", "activation"):
    register_op_handler(_kind, BoundaryHandler())
