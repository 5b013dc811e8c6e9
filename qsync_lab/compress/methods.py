"""The compression methods, one :class:`Method` each, registered once in :data:`METHODS`.

Everything the rest of the package knows of a method is read here: spec parsing
(:mod:`~qsync_lab.compress.spec`) its bits and short form, the DDP hook the module that
implements it, the simulator its traffic on the wire. Light to import (no torch), so that the
simulator costs compression without loading the hooks or the kernels.

Example::

    >>> from qsync_lab.compress.spec import CompressionSpec
    >>> cgx = METHODS["cgx"]
    >>> cgx.module, cgx.short, cgx.bits_text
    ('qsync_lab.compress.cgx', 'bits', '1..8')
    >>> wire = cgx.wire(1024, [(0, 1024)], CompressionSpec.parse("cgx:4"), 2)
    >>> wire.collective, wire.payload_bytes
    ('allgather', 520.0)
"""

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType, ModuleType
from typing import Any

__all__ = ["MAX_BITS", "METHODS", "Method", "Wire", "method_module", "padded"]

#: the most bits a spec may name (methods without a bits setting take any of 1..MAX_BITS)
MAX_BITS = 32


@dataclass(frozen=True)
class Wire:
    """One method's traffic for one bucket group, per rank.

    Attributes:
        collective: ``"allreduce"`` (codes summed in the collective) or ``"allgather"``.
        payload_bytes: bytes of the tensor the collective carries.
        scale_sync_bytes: bytes of the all-reduce(MAX) before it (0: none).
        encode_bytes: bytes the encode reads and writes per element of the gradient;
        decode_bytes: the same for decoding one rank's payload (for a roofline of their
            times where nothing was measured). An all-gather decodes one payload per rank.
    """

    collective: str
    payload_bytes: float
    scale_sync_bytes: float
    encode_bytes: float
    decode_bytes: float


def _never(spec) -> bool:
    return False


@dataclass(frozen=True)
class Method:
    """One compression method.

    Attributes:
        name: its name in specs (``"cgx"``).
        summary: what it does, in one line.
        module: the module that implements it (``encode`` and ``reduce``, see
            :mod:`~qsync_lab.compress.codec`), imported on first use (:func:`method_module`).
        wire: ``wire(numel, segments, spec, world) -> Wire``: its traffic for a group of
            ``numel`` elements made of ``segments`` (``(start, numel)`` per parameter): the
            collective, the bytes on the wire and the bytes its encode and decode touch. The
            simulator costs the group by it; the hook counts its bits.
        short: the setting its short form's argument sets (``"bits"``: ``cgx:4``;
            ``"format"``: ``aps:fp8_e4m3``; None: no argument, ``fp16``).
        example: an argument of the short form, as error messages show it.
        bits: the bits it takes (None: it has no bits setting).
        unbiased: ``unbiased(spec)``: whether the compressed mean equals the true mean in
            expectation.
        error_from_encode: its encode writes the compression error in its own pass (else the
            error is the rank's payload decoded and subtracted, which error feedback pays).
    """

    name: str
    summary: str
    module: str
    wire: Callable[[int, Sequence[tuple[int, int]], Any, int], Wire]
    short: str | None = None
    example: str = ""
    bits: Sequence[int] | None = None
    unbiased: Callable[[Any], bool] = _never
    error_from_encode: bool = False

    @property
    def bits_text(self) -> str:
        """The bits it takes, as error messages write them.

        Example::

            >>> METHODS["global_qsgd"].bits_text, METHODS["fp16"].bits_text
            ('8, 16 or 32', 'an integer in 1..32')
        """
        if self.bits is None:
            return f"an integer in 1..{MAX_BITS}"
        if isinstance(self.bits, range):
            return f"{self.bits[0]}..{self.bits[-1]}"
        *head, last = map(str, self.bits)
        return f"{', '.join(head)} or {last}"


def method_module(spec) -> ModuleType:
    """The module that implements ``spec``'s method (``encode``, ``reduce``)."""
    return importlib.import_module(METHODS[spec.method].module)


def padded(nbytes: int) -> int:
    """A packed payload's size: ``nbytes`` rounded up to a multiple of 8, so that the ranks'
    payloads, gathered side by side, keep every part aligned."""
    return -(-nbytes // 8) * 8


def _half_wire(numel, segments, spec, world) -> Wire:
    return Wire("allreduce", 2.0 * numel, 0.0, 4 + 2, 2 + 4)


def _global_qsgd_wire(numel, segments, spec, world) -> Wire:
    if spec.dithering == "exponential":
        return Wire("allgather", float(numel), 4.0, 4 + 4 + 1, 1 + 4 + 4)
    code_bytes = spec.bits // 8
    payload = 4 * -(-numel // 2) if spec.bits == 16 else numel * code_bytes  # pair16's words
    return Wire("allreduce", float(payload), 4.0, 4 + 4 + code_bytes, code_bytes + 4)


def _aps_wire(numel, segments, spec, world) -> Wire:
    return Wire("allgather", float(numel), 4.0 * len(segments), 4 + 4 + 1, 1 + 4 + 4)


def _cgx_wire(numel, segments, spec, world) -> Wire:
    groups = -(-numel // spec.group_size)
    payload = padded(-(-numel // 8) * spec.bits + 8 * groups)
    return Wire("allgather", float(payload), 0.0, 4 + 4 + spec.bits / 8, spec.bits / 8 + 4 + 4)


def _qsgd_wire(numel, segments, spec, world) -> Wire:
    return Wire("allgather", float(padded(numel + 4)), 0.0, 4 + 4 + 1, 1 + 4 + 4)


def _always(spec) -> bool:
    return True


def _stochastic_rounding(spec) -> bool:
    return spec.rounding == "stochastic"


#: name -> method, in the order error messages list them
METHODS: Mapping[str, Method] = MappingProxyType({method.name: method for method in (
    Method("fp16", "fp16 allreduce, divided by the world size first (PyTorch's "
           "fp16_compress_hook)", "qsync_lab.compress.fp16", _half_wire),
    Method("bf16", "bf16 allreduce, divided by the world size first",
           "qsync_lab.compress.fp16", _half_wire),
    Method("global_qsgd", "one shared scale (allreduce MAX), stochastic integer codes summed "
           "in the allreduce (Global-QSGD, standard or exponential dithering)",
           "qsync_lab.compress.global_qsgd", _global_qsgd_wire, short="bits", example="8",
           bits=(8, 16, 32), unbiased=_always),
    Method("aps", "a power-of-two scale per parameter (allreduce MAX of exponents), fp8 codes "
           "(APS)", "qsync_lab.compress.aps", _aps_wire, short="format", example="fp8_e4m3"),
    Method("cgx", "max-min quantization of groups to 1-8 bits, bit-packed, all-gathered (CGX)",
           "qsync_lab.compress.cgx", _cgx_wire, short="bits", example="4", bits=range(1, 9),
           unbiased=_stochastic_rounding, error_from_encode=True),
    Method("qsgd", "L2-norm-scaled stochastic levels per rank, all-gathered (QSGD)",
           "qsync_lab.compress.qsgd", _qsgd_wire, short="bits", example="4",
           bits=range(2, 9), unbiased=_always),
)})
