"""Training checkpoints, written atomically: a checkpoint is whole or absent, never half.

A checkpoint holds everything a resumed run needs to continue bit-for-bit: the model
(plain state_dict, loadable without any plan), the optimizer, the plan, the global step
(which is also the sampler's position), every rank's random-number-generator states and
the low-precision ops' stochastic-rounding counters.

Example::

    >>> import tempfile, pathlib, torch
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "checkpoint.pt"
    >>> save_checkpoint(path, {"step": 3, "model": {"w": torch.ones(2)}})
    >>> load_checkpoint(path)["step"]
    3
"""

import io
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qsync_lab.errors import QSyncError
from qsync_lab.io import atomic_write_bytes

__all__ = ["capture_rng_state", "load_checkpoint", "restore_rng_state", "save_checkpoint"]

CHECKPOINT_FORMAT = 1


def save_checkpoint(path: "str | os.PathLike[str]", state: dict[str, Any]) -> None:
    """Write ``state`` with ``torch.save`` to ``path`` atomically (temp file + fsync + rename)."""
    buffer = io.BytesIO()
    torch.save({"format": CHECKPOINT_FORMAT, **state}, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def load_checkpoint(path: "str | os.PathLike[str]") -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Raises:
        QSyncError: the file is missing, unreadable or not a qsync_lab checkpoint.
    """
    try:
        state = torch.load(Path(path), map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise QSyncError(f"no checkpoint at {path}; run without --resume to start fresh") from None
    except Exception as err:  # torch.load raises many types on a damaged file
        raise QSyncError(f"cannot read checkpoint {path}: {type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise QSyncError(f"{path} is not a qsync_lab checkpoint (format "
                         f"{state.get('format') if isinstance(state, dict) else None!r})")
    return state


def capture_rng_state() -> dict[str, Any]:
    """This process's torch, CUDA, NumPy and Python generator states."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def restore_rng_state(state: dict[str, Any]) -> None:
    """Undo everything drawn since :func:`capture_rng_state` returned ``state``."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
