"""Low-precision versions of the GEMM-shaped modules, and the boundary hooks of the others.

``QLinear``, ``QConv2d``, ``QMatMul`` and ``QEmbedding`` subclass the torch modules and add
no parameters or buffers: ``apply_plan_`` switches a module's class in place, so the
module keeps its own ``weight``/``bias`` (same tensors, same state_dict keys) and gains the
plain attributes ``op_precision`` (an :class:`OpPrecision`), ``op_seed`` and ``op_calls``
(stochastic-rounding streams: one per FQN, advanced every call). Norms, softmax and
activations keep their class; :class:`PrecisionBoundary` hooks round their input and output
(fp16/bf16 I/O, fp32 math, as mixed-precision norm and softmax kernels do).

Example::

    >>> import torch
    >>> from qsync_lab.runtime import apply_plan_
    >>> layer = torch.nn.Linear(8, 4)
    >>> apply_plan_(layer, {"": "int8"})
    >>> type(layer).__name__, layer(torch.randn(2, 8)).shape
    ('QLinear', torch.Size([2, 4]))
"""

import torch
import torch.nn.functional as F
from torch import nn

from qsync_lab.models.layers import MatMul
from qsync_lab.runtime.config import OpPrecision
from qsync_lab.runtime.functions import bilinear, embedding, precision_boundary
from qsync_lab.runtime.gemm import ConvKernel, LinearKernel, MatMulKernel


class LowPrecisionOp:
    """Mixin of the low-precision modules: config attributes and rounding streams."""

    op_precision: OpPrecision
    op_seed: int
    op_calls: int

    def next_seeds(self, count: int) -> tuple[int, ...]:
        """Stochastic-rounding seeds for this call's ``count`` operands (advances the call)."""
        call = self.op_calls
        self.op_calls = call + 1
        return tuple(hash((self.op_seed, call, i)) & (2**63 - 1) for i in range(count))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, precision={self.op_precision}"


class QLinear(LowPrecisionOp, nn.Linear):
    """``nn.Linear`` computed in ``op_precision`` (per-channel scales: weight rows)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return bilinear(LinearKernel(), input, self.weight, self.bias, self.op_precision,
                        self.next_seeds(2))


class QConv2d(LowPrecisionOp, nn.Conv2d):
    """``nn.Conv2d`` computed in ``op_precision`` (per-channel scales: output channels).

    Non-zero padding modes and string paddings are applied by padding the input first.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        padding = self.padding
        if self.padding_mode != "zeros" or isinstance(padding, str):
            mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
            input = F.pad(input, self._reversed_padding_repeated_twice, mode=mode)
            padding = (0,) * len(self.kernel_size)
        kernel = ConvKernel(self.stride, padding, self.dilation, self.groups)
        return bilinear(kernel, input, self.weight, self.bias, self.op_precision,
                        self.next_seeds(2))


class QMatMul(LowPrecisionOp, MatMul):
    """``torch.matmul(a, b)`` computed in ``op_precision`` (per-channel: rows of a,
    columns of b)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return bilinear(MatMulKernel(), a, b, None, self.op_precision, self.next_seeds(2))


class QEmbedding(LowPrecisionOp, nn.Embedding):
    """``nn.Embedding`` reading its table in ``op_precision`` (per-channel: per row)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return embedding(input, self.weight, self.op_precision, padding_idx=self.padding_idx,
                         scale_grad_by_freq=self.scale_grad_by_freq, seed=self.next_seeds(1)[0])


class PrecisionBoundary:
    """Forward hooks that put a module between two precision boundaries.

    ``before`` rounds the module's floating-point tensor inputs (and, backward, the
    gradients it returns) and ``after`` rounds its output (and the gradient it receives).
    """

    def __init__(self, cfg: OpPrecision) -> None:
        self.cfg = cfg

    def _round(self, value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return precision_boundary(value, self.cfg.forward, self.cfg.backward_precision)
        return value

    def before(self, module: nn.Module, args: tuple) -> tuple:
        return tuple(self._round(a) for a in args)

    def after(self, module: nn.Module, args: tuple, output):
        return self._round(output)
