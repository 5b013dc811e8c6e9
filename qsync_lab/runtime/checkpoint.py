"""Training checkpoints: safetensors files with a verified JSON manifest; nothing is unpickled.

A checkpoint is one file, ``checkpoint-<step:08d>.safetensors`` in the run folder, written
atomically (temp file + fsync + rename: whole or absent). Its tensors (model and optimizer
state, RNG states as uint8 tensors, compression residuals) are safetensors tensors; the rest
of the state (counters, the optimizer's param groups, NumPy and Python RNG states as lists)
is plain JSON in the file's metadata, beside the manifest: format, step, the settings that
define the run (world size and plan fingerprint among them) and the sha256 of everything
loaded (manifest, JSON state and every tensor's name, dtype, shape and bytes). Loading parses
only JSON and raw tensor bytes, so no code runs whatever the file holds, and recomputes the
sha256. A run keeps its last few checkpoints (:func:`prune_checkpoints`); a resumed run takes
the newest one that verifies (:func:`latest_valid_checkpoint`). A ``checkpoint.pt`` of the
old pickle format is refused, never opened.

Example::

    >>> import tempfile, pathlib, torch
    >>> path = checkpoint_path(pathlib.Path(tempfile.mkdtemp()), 3)
    >>> save_checkpoint(path, {"model": {"w": torch.ones(2)}, "calls": (1, 2)}, {"step": 3})
    >>> saved = load_checkpoint(path)
    >>> path.name, saved.step, saved.state["model"]["w"].tolist(), saved.state["calls"]
    ('checkpoint-00000003.safetensors', 3, [1.0, 1.0], (1, 2))
"""

import hashlib
import json
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qsync_lab.errors import QSyncError
from qsync_lab.io import atomic_write_bytes
from qsync_lab.runtime.outputs import saved_checkpoints

__all__ = ["Checkpoint", "capture_rng_state", "checkpoint_path", "latest_valid_checkpoint",
           "load_checkpoint", "prune_checkpoints", "remove_partial_writes", "restore_rng_state",
           "save_checkpoint", "settings_differences"]

CHECKPOINT_FORMAT = 2
LEGACY_CHECKPOINT = "checkpoint.pt"
_MANIFEST, _STATE = "qsync_lab.manifest", "qsync_lab.state"
_FRESH_START = "start a fresh --run-dir or re-run without --resume"
_SCALARS = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint: its ``manifest`` (format, step, settings, sha256) and ``state``."""

    path: Path
    manifest: dict[str, Any]
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def checkpoint_path(run_dir: "str | os.PathLike[str]", step: int) -> Path:
    """Where the checkpoint after ``step`` global steps goes."""
    return Path(run_dir) / f"checkpoint-{step:08d}.safetensors"


def save_checkpoint(path: "str | os.PathLike[str]", state: Mapping[str, Any],
                    manifest: Mapping[str, Any]) -> None:
    """Write ``state`` (nested dicts, lists, tuples, tensors and JSON scalars) with
    ``manifest`` (at least ``step``) to ``path`` atomically, with its sha256."""
    from safetensors.torch import save

    tensors = _Tensors()
    state_json = _json(_plain(state, "", tensors))
    manifest = {"format": CHECKPOINT_FORMAT, **manifest}
    manifest["sha256"] = _digest(_json(manifest), state_json, tensors.by_name)
    atomic_write_bytes(path, save(tensors.by_name, metadata={_MANIFEST: _json(manifest),
                                                     _STATE: state_json}))


def load_checkpoint(path: "str | os.PathLike[str]") -> Checkpoint:
    """Read and verify a checkpoint written by :func:`save_checkpoint`.

    Raises:
        QSyncError: the file is missing, is not a regular file (a FIFO would block the
            read), is not a qsync_lab checkpoint (a pickle among others: it is never
            unpickled), fails its sha256 check or has no step in its manifest; one line.
    """
    from safetensors import safe_open

    path = Path(path)
    if path.exists() and not path.is_file():
        raise QSyncError(f"{path} is not a regular file; {_FRESH_START}")
    try:
        with safe_open(path, framework="pt") as handle:  # JSON header and raw bytes only
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        manifest, state_json = json.loads(metadata[_MANIFEST]), metadata[_STATE]
        state = _restored(json.loads(state_json), tensors)
        recorded = manifest.pop("sha256")
    except FileNotFoundError:
        raise QSyncError(f"no checkpoint at {path}") from None
    except Exception as err:  # noqa: BLE001 - safetensors, JSON and key errors alike
        raise QSyncError(f"{path} is not a qsync_lab checkpoint ({_reason(path, err)}); "
                         f"{_FRESH_START}") from None
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise QSyncError(f"{path} has checkpoint format {manifest.get('format')!r}, this "
                         f"qsync_lab reads {CHECKPOINT_FORMAT}; {_FRESH_START}")
    if _digest(_json(manifest), state_json, tensors) != recorded:
        raise QSyncError(f"{path} fails its sha256 check: the file is damaged")
    step, settings = manifest.get("step"), manifest.get("settings", {})
    if type(step) is not int or step < 0 or not isinstance(settings, dict):
        raise QSyncError(f"{path} has no step or no settings table in its manifest; "
                         f"{_FRESH_START}")
    return Checkpoint(path, {**manifest, "sha256": recorded}, state)


def latest_valid_checkpoint(run_dir: "str | os.PathLike[str]",
                            warn: Callable[[str], None]) -> Checkpoint | None:
    """The newest checkpoint in ``run_dir`` that verifies; None when there is none at all.

    Each newer one that fails is reported to ``warn`` in one line.

    Raises:
        QSyncError: every checkpoint fails, or the folder holds only a legacy pickle
            ``checkpoint.pt``.
    """
    run_dir = Path(run_dir)
    paths = [path for _, path in saved_checkpoints(run_dir)]
    if not paths and (run_dir / LEGACY_CHECKPOINT).exists():
        raise QSyncError(f"{run_dir / LEGACY_CHECKPOINT} is a pickle checkpoint of an older "
                         f"qsync_lab, never loaded since it can run code; {_FRESH_START}")
    failures = []
    for path in paths:
        try:
            checkpoint = load_checkpoint(path)
        except QSyncError as err:  # what is wrong; the way out depends on what follows
            failures.append(str(err).removesuffix(f"; {_FRESH_START}"))
            continue
        for failure in failures:
            warn(f"{failure}; resuming from {path.name}")
        return checkpoint
    if failures:
        raise QSyncError(f"no valid checkpoint in {run_dir} ({len(failures)} tried, the "
                         f"newest: {failures[0]}); {_FRESH_START}")
    return None


def prune_checkpoints(run_dir: "str | os.PathLike[str]", step: int, keep: int) -> None:
    """Keep the ``keep`` newest checkpoints up to ``step``; remove older ones and any after
    ``step`` (left by an earlier attempt or run that got further, or damaged)."""
    kept = 0
    for saved_step, path in saved_checkpoints(run_dir):
        if saved_step <= step and kept < keep:
            kept += 1
        else:
            path.unlink(missing_ok=True)


def remove_partial_writes(run_dir: "str | os.PathLike[str]") -> None:
    """Remove the temporary files of checkpoint writes killed midway."""
    for partial in Path(run_dir).glob(".*.safetensors.*.tmp"):
        partial.unlink(missing_ok=True)


def settings_differences(saved: Mapping[str, Any],
                         current: Mapping[str, Any]) -> dict[str, str]:
    """``{name: "saved -> current"}`` for each setting of ``current`` that differs from
    ``saved`` (compared as JSON; a setting ``saved`` lacks is ``null``).

    Example::

        >>> settings_differences({"seed": 0, "lr": 0.05}, {"seed": 1, "lr": 0.05})
        {'seed': '0 -> 1'}
    """
    current = json.loads(json.dumps(current, allow_nan=False))  # tuples as lists, in order
    return {name: f"{_shown(saved.get(name))} -> {_shown(value)}"
            for name, value in current.items() if saved.get(name) != value}


def capture_rng_state() -> dict[str, Any]:
    """This process's torch, CUDA, NumPy and Python generator states (tensors and plain
    values, as :func:`save_checkpoint` stores them)."""
    name, keys, position, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": (str(name), keys.tolist(), int(position), int(has_gauss), float(cached)),
            "python": random.getstate()}


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Undo everything drawn since :func:`capture_rng_state` returned ``state``."""
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    random.setstate(state["python"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _plain(value: Any, key: str, tensors: "_Tensors") -> Any:
    """``value`` as JSON, each tensor stored in ``tensors`` and replaced by
    ``{"$tensor": name}``; tuples and dicts with non-string keys are tagged so that they come
    back as they were."""
    if type(value) in _SCALARS:  # most of a state: the RNG states' thousand integers
        return value
    if isinstance(value, torch.Tensor):
        return {"$tensor": tensors.add(value, key)}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return {k: _plain(v, _child(key, k), tensors) for k, v in value.items()}
        return {"$items": [[k, _plain(v, _child(key, k), tensors)] for k, v in value.items()]}
    if isinstance(value, tuple | list):
        items = [v if type(v) in _SCALARS else _plain(v, _child(key, i), tensors)
                 for i, v in enumerate(value)]
        return {"$tuple": items} if isinstance(value, tuple) else items
    if isinstance(value, bool | int | float | str):
        return value
    raise QSyncError(f"cannot checkpoint {key!r}: a {type(value).__name__} is neither a "
                     "tensor nor plain data")


def _child(key: str, part: Any) -> str:
    return f"{key}/{part}" if key else str(part)


class _Tensors:
    """The tensors of a state by name, as safetensors takes them: a view stored before
    keeps its name (tied weights are written once); one sharing memory with a stored
    tensor, or not contiguous, is stored as a copy."""

    def __init__(self) -> None:
        self.by_name: dict[str, torch.Tensor] = {}
        self._names: dict[tuple, str] = {}
        self._storages: set[int] = set()

    def add(self, value: torch.Tensor, name: str) -> str:
        tensor = value.detach().cpu()
        storage = tensor.untyped_storage().data_ptr()
        view = (storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()),
                tensor.dtype)
        if view in self._names:
            return self._names[view]
        if storage in self._storages or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        self._storages.add(storage)
        self._names[view] = name
        self.by_name[name] = tensor
        return name


def _restored(plain: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of :func:`_plain`."""
    if isinstance(plain, list):
        return [_restored(v, tensors) if type(v) in (list, dict) else v for v in plain]
    if not isinstance(plain, dict):
        return plain
    if "$tensor" in plain:
        return tensors[plain["$tensor"]]
    if "$tuple" in plain:
        return tuple(_restored(plain["$tuple"], tensors))
    if "$items" in plain:
        return {k: _restored(v, tensors) for k, v in plain["$items"]}
    return {k: _restored(v, tensors) for k, v in plain.items()}


def _digest(manifest_json: str, state_json: str, tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 of the manifest, the JSON state and every tensor (name, dtype, shape, bytes)."""
    digest = hashlib.sha256(f"{manifest_json}\0{state_json}".encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"\0{name}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _reason(path: Path, err: Exception) -> str:
    with path.open("rb") as handle:
        if handle.read(4) == b"PK\x03\x04":
            return "a torch.save pickle, never loaded since it can run code"
    text = str(err).splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _json(document: Any) -> str:
    return json.dumps(document, sort_keys=True, allow_nan=False)


def _shown(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if len(text) <= 40 else text[:16] + "..."  # a sha256: its first 16 digits
