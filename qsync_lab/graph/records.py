"""The intermediate record both tracers produce: one ``OpRecord`` per operator call.

The fx tracer and the hook tracer fill the same records, so everything downstream
(op kinds, FLOPs, bytes, depth, buckets) is computed once, from one representation.
"""

from dataclasses import dataclass, field

import torch

# Function/method names that map onto the same operator name, so that both tracers
# name an operator identically (``x + y`` is ``operator.add`` in fx and
# ``Tensor.__add__`` under a TorchFunctionMode).
_NAME_ALIASES = {
    "radd": "add",
    "iadd": "add",
    "rsub": "sub",
    "isub": "sub",
    "rmul": "mul",
    "imul": "mul",
    "truediv": "div",
    "rtruediv": "div",
    "itruediv": "div",
    "rmatmul": "matmul",
}


def op_name_of(fn_name: str) -> str:
    """Normalise a function or method name to an operator name.

    Example::

        >>> op_name_of("__radd__"), op_name_of("truediv"), op_name_of("relu_")
        ('add', 'div', 'relu')
    """
    name = fn_name.strip("_")
    return _NAME_ALIASES.get(name, name)


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor seen during tracing."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        return cls(tuple(int(s) for s in tensor.shape), tensor.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class OpRecord:
    """One operator call as recorded by a tracer.

    Attributes:
        name: unique operator FQN (a module FQN, or ``scope.function`` for functions).
        kind: operator kind (see ``qsync_lab.graph.kinds``).
        target: what was called (``torch.nn.Linear``, ``torch.matmul``, ``add`` …).
        inputs: activation tensors fed in (parameters excluded), in call order.
        input_ops: for each input, the name of the op that produced it (None = graph input).
        outputs: tensors returned.
        params: ``(parameter FQN, meta)`` for each parameter the op reads.
        plan_refusal: why a plan cannot set this call's precision ("" when it can;
            :mod:`qsync_lab.policy.kinds`).
        counted_fwd_flops: forward FLOPs ``torch.utils.flop_counter`` counted for the call
            (:mod:`qsync_lab.graph.flop_count`), for the kinds counted so (None otherwise,
            or when the call has no meta kernel).
        saved_bytes: every byte autograd keeps for the call, when the tracer works it out
            (the core of a multi-head attention,
            :func:`qsync_lab.graph.attention.core_saved_bytes`); None: the kind's rule
            (:mod:`qsync_lab.graph.opcount`).
    """

    name: str
    kind: str
    target: str
    inputs: list[TensorMeta] = field(default_factory=list)
    input_ops: list[str | None] = field(default_factory=list)
    outputs: list[TensorMeta] = field(default_factory=list)
    params: list[tuple[str, TensorMeta]] = field(default_factory=list)
    plan_refusal: str = ""
    counted_fwd_flops: int | None = None
    saved_bytes: int | None = None


class OpNamer:
    """Hands out unique operator names: ``scope.fn``, ``scope.fn_1`` …; ``module@1`` for a
    module called a second time.

    Example::

        >>> namer = OpNamer()
        >>> namer.function("encoder", "add"), namer.function("encoder", "add"), namer.module("fc")
        ('encoder.add', 'encoder.add_1', 'fc')
    """

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def _unique(self, base: str, sep: str) -> str:
        count = self._seen.get(base, 0)
        self._seen[base] = count + 1
        return base if count == 0 else f"{base}{sep}{count}"

    def module(self, fqn: str) -> str:
        return self._unique(fqn, "@")

    def function(self, scope: str, fn_name: str) -> str:
        base = f"{scope}.{op_name_of(fn_name)}" if scope else op_name_of(fn_name)
        return self._unique(base, "_")
