"""The numeric precisions an operator can run in.

Example::

    >>> from qsync_lab.precision import Precision
    >>> Precision.parse("FP16"), Precision.INT8.bits, Precision.BF16.is_float
    (<Precision.FP16: 'fp16'>, 8, True)
"""

from enum import StrEnum

from qsync_lab.errors import QSyncError


class Precision(StrEnum):
    """A compute precision; the value is the name used in plans, TOML and tables."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"
    INT8 = "int8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @classmethod
    def parse(cls, name: "str | Precision") -> "Precision":
        """Return the precision called ``name`` (case-insensitive) or raise QSyncError."""
        try:
            return cls(str(name).strip().lower())
        except ValueError:
            choices = ", ".join(p.value for p in cls)
            raise QSyncError(f"unknown precision {name!r}; choose one of: {choices}") from None

    @property
    def bits(self) -> int:
        """Storage bits of one element (tf32 is stored as 32-bit floats)."""
        return _BITS[self]

    @property
    def bytes_per_element(self) -> int:
        return self.bits // 8

    @property
    def is_float(self) -> bool:
        """True for floating-point formats, False for fixed-point (int8)."""
        return self is not Precision.INT8


_BITS = {
    Precision.FP32: 32,
    Precision.TF32: 32,
    Precision.BF16: 16,
    Precision.FP16: 16,
    Precision.INT8: 8,
    Precision.FP8_E4M3: 8,
    Precision.FP8_E5M2: 8,
}
