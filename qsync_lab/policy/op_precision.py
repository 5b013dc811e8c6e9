"""Per-operator precision config: what one operator computes in, forward and backward.

A plan maps op FQNs to an :class:`OpPrecision` (or a shorthand string). The shorthand
follows QSync: ``"int8"`` runs the forward in int8×int8→int32 and the backward in fp16,
per-tensor scales, round-to-nearest; a float precision runs both passes in itself; fp8
follows the standard FP8 training recipe (e4m3 forward operands, e5m2 gradients).

Example::

    >>> from qsync_lab.policy import OpPrecision
    >>> cfg = OpPrecision.parse("int8")
    >>> str(cfg), cfg.backward_precision
    ('int8/fp16 nearest tensor', <Precision.FP16: 'fp16'>)
    >>> cfg == OpPrecision.parse({"forward": "int8", "backward": "fp16"})
    True
    >>> OpPrecision.parse({"forward": "int8", "rounding": "stochastic"}).rounding
    'stochastic'
"""

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision

ROUNDINGS = ("nearest", "stochastic")
GRANULARITIES = ("tensor", "channel")
FP8_PRECISIONS = frozenset({Precision.FP8_E4M3, Precision.FP8_E5M2})

#: backward precision used when a config names only the forward one
DEFAULT_BACKWARD = {
    Precision.FP32: Precision.FP32,
    Precision.TF32: Precision.TF32,
    Precision.BF16: Precision.BF16,
    Precision.FP16: Precision.FP16,
    Precision.INT8: Precision.FP16,  # QSync: int8 forward, fp16 backward
    Precision.FP8_E4M3: Precision.FP8_E5M2,  # FP8 recipe: e4m3 operands, e5m2 gradients
    Precision.FP8_E5M2: Precision.FP8_E5M2,
}


@dataclass(frozen=True, eq=False)
class OpPrecision:
    """How one operator computes: forward precision, backward precision and int8 options.

    Attributes:
        forward: precision of the forward computation.
        backward: precision of the gradient computation; None means the forward's
            default (``DEFAULT_BACKWARD``). Never int8: QSync runs int8 ops' backward in float.
        rounding: "nearest" (half to even) or "stochastic"; stochastic needs int8.
        granularity: "tensor" (one scale per operand) or "channel" (one scale per output
            channel of the weight, per row/column of matmul operands); channel needs int8.

    Two configs are equal when they compute the same way (an unset backward equals the
    forward's default).
    """

    forward: Precision
    backward: Precision | None = None
    rounding: str = "nearest"
    granularity: str = "tensor"

    def __post_init__(self) -> None:
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if not (isinstance(value, Precision) or (name == "backward" and value is None)):
                raise QSyncError(
                    f"OpPrecision.{name} must be a Precision, got {value!r}; "
                    f"build configs from strings with OpPrecision.parse"
                )
        if self.backward is Precision.INT8:
            raise QSyncError(
                "backward precision int8 is not supported; int8 operators run their "
                "backward in fp16, bf16, tf32 or fp32"
            )
        if self.rounding not in ROUNDINGS:
            raise QSyncError(
                f"unknown rounding {self.rounding!r}; choose 'nearest' or 'stochastic'"
            )
        if self.granularity not in GRANULARITIES:
            raise QSyncError(
                f"unknown granularity {self.granularity!r}; choose 'tensor' or 'channel'"
            )
        for option, default in (("rounding", "nearest"), ("granularity", "tensor")):
            if getattr(self, option) != default and self.forward is not Precision.INT8:
                raise QSyncError(
                    f"{option}={getattr(self, option)!r} applies to int8 operators only, "
                    f"not {self.forward}; use {option}={default!r} or forward int8"
                )
        # how it computes, kept for __eq__ and __hash__ (configs key memos of plans)
        object.__setattr__(self, "_computes", (self.forward, self.backward_precision,
                                               self.rounding, self.granularity))

    @classmethod
    def parse(cls, spec: "str | Precision | OpPrecision | Mapping[str, str]") -> "OpPrecision":
        """Build a config from a precision name, a Precision, a mapping or a config.

        A mapping has the field names as keys (``forward`` required), as a plan's JSON does.
        """
        if isinstance(spec, OpPrecision):
            return spec
        if isinstance(spec, Mapping):
            unknown = set(spec) - {"forward", "backward", "rounding", "granularity"}
            if unknown or "forward" not in spec:
                raise QSyncError(
                    f"op precision mapping {dict(spec)!r} needs key 'forward' and may have "
                    "'backward', 'rounding', 'granularity' only"
                )
            backward = spec.get("backward")
            return cls(
                Precision.parse(spec["forward"]),
                None if backward is None else Precision.parse(backward),
                spec.get("rounding", "nearest"),
                spec.get("granularity", "tensor"),
            )
        if isinstance(spec, str):
            return _plain(Precision.parse(spec))
        raise QSyncError(
            f"op precision must be a precision name, Precision, OpPrecision or mapping, "
            f"got {type(spec).__name__}"
        )

    @property
    def backward_precision(self) -> Precision:
        """The backward precision, with the forward's default filled in."""
        return DEFAULT_BACKWARD[self.forward] if self.backward is None else self.backward

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpPrecision) and self._computes == other._computes

    def __hash__(self) -> int:
        return hash(self._computes)

    @property
    def is_fp32(self) -> bool:
        """True when both passes run in plain fp32 (the operator is left unchanged)."""
        return self.forward is Precision.FP32 and self.backward_precision is Precision.FP32

    def to_dict(self) -> dict[str, str]:
        """JSON-ready form with the backward precision resolved (``parse`` reads it back)."""
        return {
            "forward": str(self.forward),
            "backward": str(self.backward_precision),
            "rounding": self.rounding,
            "granularity": self.granularity,
        }

    def __str__(self) -> str:
        return f"{self.forward}/{self.backward_precision} {self.rounding} {self.granularity}"


@functools.cache
def _plain(precision: Precision) -> OpPrecision:
    """The config of plain ``precision``, one shared instance per precision (equal configs
    that are the same object compare at once in the allocator's memo keys)."""
    return OpPrecision(precision)
