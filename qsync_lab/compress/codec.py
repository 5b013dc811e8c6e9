"""What every compression method provides, and the shared pieces of their payloads.

A method (one module each: :mod:`~qsync_lab.compress.fp16`, :mod:`~qsync_lab.compress.global_qsgd`,
:mod:`~qsync_lab.compress.aps`, :mod:`~qsync_lab.compress.cgx`, :mod:`~qsync_lab.compress.qsgd`)
has three functions over one flat float32 gradient ``x`` holding one or more parameters
(``segments``: their ``(start, numel)``):

* ``encode(x, segments, spec, comm, seed) -> Encoded``: this rank's payload (a scale
  all-reduce first where the method has one);
* ``reduce(encoded, spec, comm, out=None) -> Tensor``: the collective and the decode: the
  mean over the ranks as the method computes it, written into ``out`` (the bucket's
  gradient, any float dtype) where given, else a new float32 tensor;
* ``wire(numel, segments, spec, world) -> Wire``: what goes over the wire, for the
  simulator.

``Encoded.own`` is this rank's gradient as the method compresses it (for error feedback and
the telemetry's relative error). A rank whose gradient holds NaN or Inf marks its payload
(:data:`NONFINITE`), every rank sees the mark after the collective, and every rank raises
:class:`NonFiniteGradient`: the ranks stop together, nothing is averaged silently.
"""

from dataclasses import dataclass
from typing import Any

import torch

from qsync_lab.errors import QSyncError

__all__ = ["NONFINITE", "Encoded", "NonFiniteGradient", "Wire", "check_finite", "float_sum_target",
           "into", "pack", "unpack"]

#: the value a rank puts in its scale when its gradient is not finite
NONFINITE = float("inf")


class NonFiniteGradient(QSyncError):
    """A gradient holds NaN or Inf on some rank; every rank raises it for the same bucket."""


@dataclass(frozen=True)
class Encoded:
    """One rank's payload and what decoding it needs.

    Attributes:
        payload: the tensor the collective carries.
        context: whatever the method's ``reduce`` needs besides it (scales, shifts).
        own: this rank's gradient as compressed (None when nobody asked for it).
    """

    payload: torch.Tensor
    context: Any
    own: torch.Tensor | None = None


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


def check_finite(flags: torch.Tensor, what: str) -> None:
    """Raise :class:`NonFiniteGradient` if any rank marked its payload (``flags`` after the
    collective, on every rank alike)."""
    if not bool(torch.isfinite(flags).all()):
        raise NonFiniteGradient(f"a gradient of {what} holds NaN or Inf on some rank; the "
                                "step is stopped on every rank (lower the learning rate, or "
                                "check the data and the loss)")


def into(out: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """``values`` copied into ``out`` (cast to its dtype), or ``values`` when ``out`` is None."""
    return values if out is None else out.copy_(values)


def float_sum_target(out: torch.Tensor | None, numel: int) -> torch.Tensor:
    """A zeroed float32 tensor to add the ranks' values into: ``out`` itself when it is a
    contiguous float32 tensor, else a new one (then copied by :func:`into`)."""
    if out is not None and out.dtype == torch.float32 and out.is_contiguous():
        return out.zero_()
    return torch.zeros(numel, dtype=torch.float32)


def pack(*parts: torch.Tensor) -> torch.Tensor:
    """Tensors as one flat uint8 tensor (an all-gather carries one tensor per rank)."""
    return torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts])


def unpack(data: torch.Tensor, *layout: tuple[torch.dtype, int]) -> list[torch.Tensor]:
    """The tensors :func:`pack` joined: ``layout`` is ``(dtype, numel)`` per part.

    Example::

        >>> parts = unpack(pack(torch.tensor([1.5]), torch.tensor([7], dtype=torch.int8)),
        ...                (torch.float32, 1), (torch.int8, 1))
        >>> [p.tolist() for p in parts]
        [[1.5], [7]]
    """
    out, start = [], 0
    for dtype, numel in layout:
        size = numel * torch.empty(0, dtype=dtype).element_size()
        out.append(data[start:start + size].view(dtype))
        start += size
    return out
