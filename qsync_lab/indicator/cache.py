"""A model's indicator, computed once and kept on disk.

Scoring a model (calibration passes in every precision) takes seconds to minutes, and the
lab opens the same model again and again. :func:`cached_indicator` keys the scores by what
they are computed from: the model's parameters and buffers (their bytes), its graph, the
calibration batches, the loss, the precisions, the software and the code that scores; they
are kept as CSV under ``$QSYNC_LAB_CACHE/indicators/`` (written atomically; never
unpickled), and a change to any of them scores again.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.graph import trace_graph
    >>> model, x = nn.Sequential(nn.Linear(8, 4)), torch.randn(2, 8)
    >>> key = indicator_key(model, trace_graph(model, x), [(x,)], nn.MSELoss(), ["fp16"])
    >>> len(key), key == indicator_key(model, trace_graph(model, x), [(x,)], nn.MSELoss(),
    ...                                ["fp16"])
    (32, True)
"""

import functools
import hashlib
import importlib.util
import io
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
import torch
from torch import nn

from qsync_lab.io import atomic_write_text
from qsync_lab.profile.timing import _package_version
from qsync_lab.resources import cache_dir

__all__ = ["cached_indicator", "indicator_key"]

#: what a cached indicator holds; a new value leaves older ones unread
CACHE_FORMAT = "indicator-1"


def indicator_key(model: nn.Module, graph, batches: Sequence, loss_fn,
                  precisions: Sequence) -> str:
    """A hash of everything the indicator of ``model`` depends on."""
    h = hashlib.sha256()
    for part in (CACHE_FORMAT, graph.fingerprint(), type(loss_fn).__name__,
                 ",".join(map(str, precisions)), torch.__version__,
                 _package_version("qsync-lab"), _code_digest()):
        h.update(f"{part}\n".encode())
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        _hash_tensor(h, tensor)
    for batch in batches:
        for tensor in _tensors(batch):
            _hash_tensor(h, tensor)
    return h.hexdigest()[:32]


def cached_indicator(key: str, compute: Callable[[], pd.DataFrame]) -> pd.DataFrame:
    """The scores cached under ``key``, else ``compute()``, cached."""
    path = cache_dir() / "indicators" / f"{key}.csv"
    if path.is_file():
        return pd.read_csv(path, header=[0, 1], index_col=0)
    scores = compute()
    buffer = io.StringIO()
    scores.to_csv(buffer, float_format="%.17g")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, buffer.getvalue())
    return scores


@functools.cache
def _code_digest() -> str:
    """A hash of the code that computes the scores (the indicator and the kernels it
    quantizes with): a change to either scores again."""
    h = hashlib.sha256()
    folders = [Path(__file__).parent,
               *map(Path, importlib.util.find_spec("qsync_lab.kernels").submodule_search_locations)]
    for path in sorted(p for folder in folders for p in folder.glob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()


def _hash_tensor(h, tensor: torch.Tensor) -> None:
    t = tensor.detach().cpu().contiguous().reshape(-1)
    h.update(f"{t.dtype}{tuple(tensor.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in _tensors(value[k])]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []

