"""Low-precision versions of the GEMM-shaped modules, and the boundary hooks of the norms.

``QLinear``, ``QConv1d``/``2d``/``3d``, ``QMatMul`` and ``QEmbedding`` subclass the torch
modules and add no parameters or buffers: ``apply_plan_`` switches a module's class in place,
so the module keeps its own ``weight``/``bias`` (same tensors, same state_dict keys) and gains
the plain attributes ``op_precision`` (an :class:`~qsync_lab.policy.OpPrecision`),
``op_seed`` and ``op_calls`` (stochastic-rounding streams: one per FQN, advanced every call).
A subclass of a torch module that keeps the torch forward (``nn.MultiheadAttention``'s
``NonDynamicallyQuantizableLinear``, a module declaring ``op_kind = "matmul"``) gets a
low-precision class of its own (:func:`low_precision_class`). Norms keep their class;
:class:`PrecisionBoundary` hooks round their input and output (fp16/bf16 I/O, fp32 math,
as mixed-precision norm kernels do).

Example::

    >>> import torch
    >>> from qsync_lab.quant import apply_plan_
    >>> layer = torch.nn.Linear(8, 4)
    >>> apply_plan_(layer, {"": "int8"})
    >>> type(layer).__name__, layer(torch.randn(2, 8)).shape
    ('QLinear', torch.Size([2, 4]))
"""

import torch
import torch.nn.functional as F
from torch import nn

from qsync_lab.models.layers import MatMul
from qsync_lab.policy import OpPrecision
from qsync_lab.quant.functions import bilinear, embedding, precision_boundary
from qsync_lab.quant.gemm import ConvKernel, LinearKernel, MatMulKernel
from qsync_lab.quant.native import fp32_inputs, runs_native

__all__ = ["LowPrecisionOp", "PrecisionBoundary", "QConv1d", "QConv2d", "QConv3d",
           "QEmbedding", "QLinear", "QMatMul", "low_precision_class", "stream_seeds"]


def stream_seeds(op_seed: int, call: int, count: int) -> tuple[int, ...]:
    """Stochastic-rounding seeds of call ``call`` of the op with seed ``op_seed``."""
    return tuple(hash((op_seed, call, i)) & (2**63 - 1) for i in range(count))


class LowPrecisionOp:
    """Mixin of the low-precision modules: config attributes and rounding streams.

    ``op_float_class`` is the module class a low-precision class was made from (the policy
    judges a module by it).
    """

    op_precision: OpPrecision
    op_seed: int
    op_calls: int
    op_float_class: type

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        cls.op_float_class = mro[mro.index(LowPrecisionOp) + 1]

    def next_seeds(self, count: int) -> tuple[int, ...]:
        """Stochastic-rounding seeds for this call's ``count`` operands, zeros for an op that
        rounds to nearest (it uses none); advances the call either way."""
        call = self.op_calls
        self.__dict__["op_calls"] = call + 1  # a plain attribute: no nn.Module.__setattr__
        if self.op_precision.rounding != "stochastic":
            return (0,) * count
        return stream_seeds(self.op_seed, call, count)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, precision={self.op_precision}"


class _LinearForward(LowPrecisionOp):
    """``nn.Linear`` computed in ``op_precision`` (per-channel scales: weight rows)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return bilinear(LinearKernel(), input, self.weight, self.bias, self.op_precision,
                        self.next_seeds(2))


class _TransposedLinearForward(LowPrecisionOp):
    """A linear map that stores its weight ``(in, out)`` (GPT-2's ``Conv1D``) computed in
    ``op_precision``, as ``nn.Linear`` with the transposed weight."""

    op_linear_layout = "transposed"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return bilinear(LinearKernel(), input, self.weight.t(), self.bias, self.op_precision,
                        self.next_seeds(2))


class _ConvForward(LowPrecisionOp):
    """``nn.Conv1d``/``2d``/``3d`` computed in ``op_precision`` (per-channel scales: output
    channels). Non-zero padding modes and string paddings pad the input first."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        padding = self.padding
        if self.padding_mode != "zeros" or isinstance(padding, str):
            mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
            input = F.pad(input, self._reversed_padding_repeated_twice, mode=mode)
            padding = (0,) * len(self.kernel_size)
        kernel = ConvKernel(self.stride, padding, self.dilation, self.groups)
        return bilinear(kernel, input, self.weight, self.bias, self.op_precision,
                        self.next_seeds(2))


class _MatMulForward(LowPrecisionOp):
    """``torch.matmul(a, b)`` computed in ``op_precision`` (per-channel: rows of a, columns
    of b)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return bilinear(MatMulKernel(), a, b, None, self.op_precision, self.next_seeds(2))


class _EmbeddingForward(LowPrecisionOp):
    """``nn.Embedding`` reading its table in ``op_precision`` (per-channel: per row)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return embedding(input, self.weight, self.op_precision, padding_idx=self.padding_idx,
                         scale_grad_by_freq=self.scale_grad_by_freq, seed=self.next_seeds(1)[0])


class QLinear(_LinearForward, nn.Linear):
    """``nn.Linear`` in low precision."""


class QConv1d(_ConvForward, nn.Conv1d):
    """``nn.Conv1d`` in low precision."""


class QConv2d(_ConvForward, nn.Conv2d):
    """``nn.Conv2d`` in low precision."""


class QConv3d(_ConvForward, nn.Conv3d):
    """``nn.Conv3d`` in low precision."""


class QMatMul(_MatMulForward, MatMul):
    """The zoo's ``MatMul`` in low precision."""


class QEmbedding(_EmbeddingForward, nn.Embedding):
    """``nn.Embedding`` in low precision."""


#: op kind -> the mixin whose forward replaces the module's
FORWARDS: dict[str, type[LowPrecisionOp]] = {
    "linear": _LinearForward, "conv1d": _ConvForward, "conv2d": _ConvForward,
    "conv3d": _ConvForward, "matmul": _MatMulForward, "embedding": _EmbeddingForward,
}
_LOW_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: QLinear, nn.Conv1d: QConv1d, nn.Conv2d: QConv2d, nn.Conv3d: QConv3d,
    MatMul: QMatMul, nn.Embedding: QEmbedding,
}


def low_precision_class(cls: type[nn.Module], kind: str, *,
                        transposed: bool = False) -> type[nn.Module]:
    """The low-precision class of module class ``cls`` (an op of ``kind``; ``transposed``:
    a linear map whose weight is ``(in, out)``), made once.

    Example::

        >>> from torch import nn
        >>> class Projection(nn.Linear):
        ...     pass
        >>> cls = low_precision_class(Projection, "linear")
        >>> cls.__name__, issubclass(cls, Projection), cls is low_precision_class(Projection, "linear")
        ('QProjection', True, True)
    """
    if cls not in _LOW_CLASSES:
        forward = _TransposedLinearForward if transposed else FORWARDS[kind]
        _LOW_CLASSES[cls] = type(f"Q{cls.__name__}", (forward, cls),
                                 {"__module__": cls.__module__, "__doc__": cls.__doc__})
    return _LOW_CLASSES[cls]


class PrecisionBoundary:
    """Forward hooks that put a module between two precision boundaries.

    ``before`` rounds the module's floating-point tensor inputs (and, backward, the
    gradients it returns) and ``after`` rounds its output (and the gradient it receives).
    Natively (:func:`~qsync_lab.quant.native.runs_native`) they cast instead: a module with
    ``fp32_inside`` (a norm, whose CUDA kernels want inputs of its parameters' dtype) takes
    fp32 inputs, others (activations) fp16/bf16 ones, and both write fp16/bf16.
    """

    def __init__(self, cfg: OpPrecision, *, fp32_inside: bool = True) -> None:
        self.cfg = cfg
        self.fp32_inside = fp32_inside

    def _round(self, value, *, entering: bool = False):
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            return value
        if entering and self.fp32_inside and runs_native(value):
            return fp32_inputs(None, (value,))[0]
        return precision_boundary(value, self.cfg.forward, self.cfg.backward_precision)

    def before(self, module: nn.Module, args: tuple) -> tuple:
        return tuple(self._round(a, entering=True) for a in args)

    def after(self, module: nn.Module, args: tuple, output):
        return self._round(output)
