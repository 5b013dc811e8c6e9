"""What every compression method provides, and the shared pieces of their payloads.

A method (one module each: :mod:`~qsync_lab.compress.fp16`, :mod:`~qsync_lab.compress.global_qsgd`,
:mod:`~qsync_lab.compress.aps`, :mod:`~qsync_lab.compress.cgx`, :mod:`~qsync_lab.compress.qsgd`)
has two functions over one flat float32 gradient ``x`` holding one or more parameters
(``segments``: their ``(start, numel)``):

* ``encode(x, segments, spec, comm, seed, error=False, workspace=None) -> Encoded``: this
  rank's payload (a scale all-reduce first where the method has one);
* ``reduce(encoded, spec, comm, out=None, workspace=None) -> Tensor``: the collective and
  the decode: the mean over the ranks as the method computes it, written into ``out`` (the
  bucket's gradient, any float dtype) where given, else a new float32 tensor.

Their traffic on the wire, which the simulator costs, is the registry's
(:attr:`Method.wire <qsync_lab.compress.methods.Method>`, light to import).

Both take their payload, gather and decode buffers from a :class:`Workspace` (the hook keeps
one; without it they allocate). ``Encoded.error`` is this rank's compression error, ``x``
minus its gradient as the method compresses it (for error feedback and the telemetry's
relative error). A rank whose gradient holds NaN or Inf marks its payload
(:data:`NONFINITE`), every rank sees the mark after the collective, and every rank raises
:class:`NonFiniteGradient`: the ranks stop together, nothing is averaged silently.

On CUDA tensors (:func:`on_device`) no encode or reduce reads a value back to the host: the
scales, norms, maxima and marks stay device tensors that feed the next kernel or torch op
(a kernel reads its scale from a device array), so the host only queues work. A marked
bucket then raises nothing inside the call: the mark, seen by every rank after the
collective, is kept in the workspace (:meth:`Workspace.note_nonfinite`; the hook's
:meth:`~qsync_lab.compress.hook.CompressionState.check_finite` reads it once per step and
raises :class:`NonFiniteGradient` on every rank) and the bucket's mean is not finite (NaN
throughout for the methods with a scale; the marked values' own elements or groups for
fp16/bf16 and CGX), so nothing is averaged silently there either.
"""

from dataclasses import dataclass
from typing import Any

import torch

from qsync_lab.compress.methods import padded
from qsync_lab.errors import QSyncError

__all__ = ["DEVICE_PATH_ON_CPU", "NONFINITE", "Encoded", "NonFiniteGradient", "Workspace",
           "check_finite", "compression_error", "cuda_kernels", "float_target", "into",
           "nonfinite", "on_device", "packed_parts", "poison", "take", "unpack"]

#: the value a rank puts in its scale when its gradient is not finite
NONFINITE = float("inf")

#: run the device path (see :func:`on_device`) on CPU tensors too, its kernels in Numba's CUDA
#: simulator (``NUMBA_ENABLE_CUDASIM=1``): how the tests check that path without a GPU
DEVICE_PATH_ON_CPU = False


class NonFiniteGradient(QSyncError):
    """A gradient holds NaN or Inf on some rank; every rank raises it for the same bucket."""


@dataclass(frozen=True)
class Encoded:
    """One rank's payload and what decoding it needs.

    Attributes:
        payload: the tensor the collective carries.
        context: whatever the method's ``reduce`` needs besides it (scales, shifts).
        error: ``x`` minus this rank's gradient as compressed, float32 (None when nobody
            asked for it).
    """

    payload: torch.Tensor
    context: Any
    error: torch.Tensor | None = None


class Workspace:
    """Buffers that the methods' encode and reduce reuse from call to call, one per role.

    A new tensor of several MB costs a page fault per page the first time it is written,
    on a CPU often as long as quantizing into it (unless the process keeps its freed
    memory, :mod:`qsync_lab.hostmem`, as the training ranks do). The hook's sender thread
    reduces one parameter group at a time, so one buffer per role (codes, gathered
    payloads, ...), grown to the largest group, serves every bucket. A buffer handed out is
    valid until the same role is taken again.

    Example::

        >>> ws = Workspace()
        >>> a = ws.take("codes", 8, torch.int8)
        >>> b = ws.take("codes", 4, torch.int8)
        >>> b.data_ptr() == a.data_ptr(), tuple(b.shape), ws.nbytes
        (True, (4,), 8)
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self._nonfinite: dict[tuple[str, torch.device], torch.Tensor] = {}
        #: the mark of the last bucket reduced on the device path (see :func:`nonfinite`)
        self.last_nonfinite: torch.Tensor | None = None

    def take(self, role: str, numel: int, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> torch.Tensor:
        """A flat contiguous ``dtype`` tensor of ``numel`` elements for ``role`` (its contents
        are whatever the role's last user left)."""
        key = (role, dtype, torch.device(device))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def note_nonfinite(self, bad: torch.Tensor, what: str) -> None:
        """Keep a device path bucket's mark (a 0-d bool device tensor, never read here): the
        last one, and or-ed into the marks since :meth:`pop_nonfinite`, per ``what``."""
        self.last_nonfinite = bad
        key = (what, bad.device)
        mark = self._nonfinite.get(key)
        self._nonfinite[key] = bad.clone() if mark is None else mark.logical_or_(bad)

    def pop_nonfinite(self) -> dict[str, torch.Tensor]:
        """The marks kept since the last call (``what`` -> 0-d bool tensor), forgotten here."""
        marks, self._nonfinite = self._nonfinite, {}
        return {what: mark for (what, _), mark in marks.items()}


def take(workspace: "Workspace | None", role: str, numel: int, dtype: torch.dtype,
         device) -> torch.Tensor:
    """``workspace.take(...)``, or a new tensor when there is no workspace."""
    if workspace is None:
        return torch.empty(numel, dtype=dtype, device=device)
    return workspace.take(role, numel, dtype, device)


def check_finite(flags: torch.Tensor, what: str) -> None:
    """Raise :class:`NonFiniteGradient` if any rank marked its payload (``flags`` after the
    collective, on every rank alike)."""
    if not bool(torch.isfinite(flags).all()):
        raise NonFiniteGradient(f"a gradient of {what} holds NaN or Inf on some rank; the "
                                "step is stopped on every rank (lower the learning rate, or "
                                "check the data and the loss)")


def on_device(x: torch.Tensor) -> bool:
    """Whether a method runs its device path on ``x``: a CUDA tensor (or any tensor, with
    :data:`DEVICE_PATH_ON_CPU`). There nothing is read back to the host (no ``.item()``,
    ``float()``, ``bool()`` or ``.tolist()`` of a tensor, no copy to the CPU): the kernels are
    the CUDA ones (:func:`cuda_kernels`), fed device arrays. The CPU path keeps its Python
    numbers (reading a CPU tensor costs no synchronisation)."""
    return x.is_cuda or DEVICE_PATH_ON_CPU


def cuda_kernels():
    """The CUDA kernels' module (``qsync_lab.kernels.cuda``, in Numba's simulator where
    ``NUMBA_ENABLE_CUDASIM=1``), for the device path's direct launches."""
    from qsync_lab.kernels.plumbing import _cuda

    return _cuda()


def nonfinite(flags: torch.Tensor, what: str, workspace: "Workspace | None",
              device: bool) -> torch.Tensor | None:
    """The check after the collective that some rank marked its payload (``flags`` not all
    finite, on every rank alike). CPU path (``device`` False): :func:`check_finite`, which
    raises; returns None. Device path: the mark as a 0-d bool device tensor, kept in the
    workspace (:meth:`Workspace.note_nonfinite`), nothing read or raised."""
    if not device:
        check_finite(flags, what)
        return None
    bad = torch.isfinite(flags).all().logical_not()
    if workspace is not None:
        workspace.note_nonfinite(bad, what)
    return bad


def poison(bad: torch.Tensor) -> torch.Tensor:
    """A 0-d float32 device tensor, NaN where ``bad`` is true else 1.0: a decode's scale times
    it gives a marked bucket a NaN mean and leaves every other one bit for bit as it was."""
    return torch.where(bad, float("nan"), 1.0)


def compression_error(x: torch.Tensor, own: torch.Tensor,
                      workspace: "Workspace | None" = None) -> torch.Tensor:
    """``x - own`` (float32, x's shape) in the workspace's ``"error"`` buffer: the error of
    ``own``, this rank's gradient as compressed."""
    error = take(workspace, "error", x.numel(), torch.float32, x.device).view(x.shape)
    return torch.sub(x, own.view(x.shape), out=error)


def into(out: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """``values`` copied into ``out`` (cast to its dtype), or ``values`` when ``out`` is None."""
    return values if out is None else out.copy_(values)


def float_target(out: torch.Tensor | None, numel: int,
                 workspace: Workspace | None = None, device=None) -> torch.Tensor:
    """A float32 tensor for the ranks' mean: ``out`` itself when it is a contiguous float32
    tensor, else a workspace buffer or a new one (then copied by :func:`into`) on ``out``'s
    device (without ``out``: on ``device``, the payload's, default the CPU)."""
    if out is not None and out.dtype == torch.float32 and out.is_contiguous():
        return out
    device = out.device if out is not None else (device if device is not None else "cpu")
    return take(workspace, "sum", numel, torch.float32, device)


def packed_parts(workspace: Workspace | None, device, *layout: tuple[torch.dtype, int]):
    """One flat uint8 payload buffer (the workspace's ``"payload"``; an all-gather carries one
    tensor per rank) and views of its parts, one after the other (``layout``: ``(dtype,
    numel)`` per part), padded to a multiple of 8 bytes: the parts are written in place.

    Example::

        >>> data, (scale, codes) = packed_parts(None, "cpu", (torch.float32, 1),
        ...                                     (torch.int8, 3))
        >>> scale.fill_(1.5); codes.fill_(7)  # doctest: +ELLIPSIS
        tensor(...
        >>> tuple(data.shape), [p.tolist() for p in unpack(data, (torch.float32, 1),
        ...                                                (torch.int8, 3))]
        ((8,), [[1.5], [7, 7, 7]])
    """
    size = sum(numel * torch.empty(0, dtype=dtype).element_size() for dtype, numel in layout)
    data = take(workspace, "payload", padded(size), torch.uint8, device)
    return data, unpack(data, *layout)


def unpack(data: torch.Tensor, *layout: tuple[torch.dtype, int]) -> list[torch.Tensor]:
    """Views of the parts of a :func:`packed_parts` payload (a gathered rank's too):
    ``layout`` is ``(dtype, numel)`` per part."""
    out, start = [], 0
    for dtype, numel in layout:
        size = numel * torch.empty(0, dtype=dtype).element_size()
        out.append(data[start:start + size].view(dtype))
        start += size
    return out
