"""Where a profile runs, and the device its rows are named after.

:func:`profile_device` checks the device a profile is asked for: ``"cpu"`` (the default
everywhere), or ``"cuda"`` (``"cuda:i"``) when torch sees a GPU. :func:`to_device` moves
a batch there. :func:`profile_device_name` is the ``device`` of the profile's rows and
metadata: ``cpu``, or the catalog kind of the GPU (:func:`gpu_kind`: matched by its
reported name, memory and compute capability against the catalog's kinds, so
``NVIDIA H100 80GB HBM3`` -> ``H100-SXM5-80GB``), else the name the GPU reports (add a
catalog entry of that name to cost it: the cost model looks rows up by catalog kind).

Example::

    >>> profile_device("cpu"), profile_device_name("cpu")
    (device(type='cpu'), 'cpu')
    >>> from qsync_lab.devices import load_catalog
    >>> gpu_kind(load_catalog(), "Tesla T4", memory_bytes=15_642_329_088,
    ...          compute_capability=(7, 5))
    'T4'
"""

import re

import torch
from torch import fx

from qsync_lab.devices import BYTES_PER_GIB, DeviceCatalog, load_catalog
from qsync_lab.errors import QSyncError

__all__ = ["gpu_kind", "profile_device", "profile_device_name", "to_device"]

_FORM_FACTOR = re.compile(r"SXM\d*|PCIE|NVL")
_MEMORY_PART = re.compile(r"(\d+)GB")
_MEMORY_TOLERANCE = 0.1


def profile_device(device: "torch.device | str") -> torch.device:
    """``device`` as a torch device a profile can run on: the CPU, or a CUDA GPU torch sees.

    Raises:
        QSyncError: another device type, or CUDA without a GPU.
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise QSyncError(f"unknown profiling device {device!r}; use 'cpu' or 'cuda'") from None
    if parsed.type not in ("cpu", "cuda"):
        raise QSyncError(f"cannot profile on {parsed.type}; use 'cpu' or 'cuda'")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise QSyncError("no CUDA GPU is visible to torch; profile on the CPU (device='cpu', qsync-lab profile --device cpu)")
    return parsed


def profile_device_name(device: "torch.device | str") -> str:
    """The device name a profile's rows carry: ``cpu``, or the catalog kind of the CUDA GPU
    (:func:`gpu_kind`), else the name the GPU reports."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    gpu = torch.cuda.get_device_properties(device)
    return gpu_kind(load_catalog(), gpu.name, memory_bytes=gpu.total_memory,
                    compute_capability=(gpu.major, gpu.minor)) or gpu.name


def gpu_kind(catalog: DeviceCatalog, name: str, *, memory_bytes: int,
             compute_capability: tuple[int, int]) -> str | None:
    """The catalog kind of a GPU that reports ``name`` (``torch.cuda.get_device_name``),
    its memory and compute capability; None when no kind matches.

    A GPU kind of the same compute capability matches when each part of its name (split at
    ``-``) is a part of ``name`` (split at spaces and ``-``, any case), except a form factor
    (``SXM5``) that ``name`` leaves out (it names no other), and a memory size (``80GB``)
    that is the GPU's memory in GiB within 10 %. Of several, the kind with the most name
    parts wins.

    Example::

        >>> gpu_kind(load_catalog(), "NVIDIA H100 80GB HBM3", memory_bytes=85_520_809_984,
        ...          compute_capability=(9, 0))
        'H100-SXM5-80GB'
        >>> gpu_kind(load_catalog(), "NVIDIA H100 PCIe", memory_bytes=85_520_809_984,
        ...          compute_capability=(9, 0)) is None
        True
    """
    parts = set(_name_parts(name))
    names_form = any(_FORM_FACTOR.fullmatch(p) for p in parts)
    best, most = None, 0
    for spec in catalog.devices.values():
        if spec.kind != "gpu" or spec.compute_capability != tuple(compute_capability):
            continue
        wanted = _name_parts(spec.name)
        if len(wanted) > most and all(p in parts or (_FORM_FACTOR.fullmatch(p) and not names_form)
                                      or _same_memory(p, memory_bytes) for p in wanted):
            best, most = spec.name, len(wanted)
    return best


def _name_parts(name: str) -> list[str]:
    return [p for p in re.split(r"[\s_-]+", name.upper()) if p]


def _same_memory(part: str, memory_bytes: int) -> bool:
    """Whether name part ``part`` is a memory size (``80GB``) within 10 % of the GPU's."""
    size = _MEMORY_PART.fullmatch(part)
    return bool(size) and abs(memory_bytes / BYTES_PER_GIB / int(size.group(1)) - 1) <= \
        _MEMORY_TOLERANCE


def to_device(value, device: "torch.device | str"):
    """``value`` (a tensor, or tuples, lists and dicts of them) with its tensors on
    ``device`` (the same tensors where they are there already)."""
    return fx.node.map_aggregate(value, lambda x: x.to(device) if isinstance(x, torch.Tensor)
                                 else x)
