"""Measured profile tables: the CSV format, reading, writing and lookup.

A profile is ``data/profiles/<device>.csv`` (or any path): ``# key: value`` metadata lines
first (software versions, date, host), then a CSV with the columns of
:data:`PROFILE_COLUMNS`, one row per measured (device, op, precision, phase, batch size):

========== ==============================================================================
device     catalog device name the row was measured on (or emulates)
op         op FQN in the profiled graph (empty when only the shape key should match); a
           compression row's spec (its cost label, e.g. ``global_qsgd:8``)
kind       op kind (``linear``...), ``cast`` for a cast row; a compression row's step:
           ``encode``, ``decode`` (one rank's payload) or ``in_step`` (what the hook added
           to real DDP steps beyond the simulator's estimate, per compressed group call;
           its ``time_us`` may be negative)
shape_key  :func:`qsync_lab.costs.shape_key` of the op at ``batch_size`` (empty for casts)
precision  the precision the phase computed in; ``src->dst`` (``fp32->fp16``) for a cast
plan_precision the precision the plan gives the op, the lookup key: it differs from
           ``precision`` for an int8 op's backward (computed in fp16), which must not be
           taken for an fp16 op's backward (no dequantisation of saved int8 tensors);
           optional on reading (default: ``precision``)
phase      ``forward``, ``backward_input``, ``backward_weight``, ``cast`` or ``compress``
batch_size per-rank batch size of the measurement (0 for casts)
numel      elements converted or compressed (casts, compression; 0 otherwise)
flops      FLOPs of the measured work (:func:`qsync_lab.costs.phase_work`)
bytes      bytes of the measured work (same)
time_us    median time of one run
repeats    how many timed runs the median is over
========== ==============================================================================

Metadata keys the profiler writes: ``torch_version``, ``cuda_version``, ``device_name``,
``qsync_lab_version``, ``date``. Rows match an op by (device, FQN, precision, phase,
batch size) first, then by (device, kind, shape key, precision, phase), the precision
being the plan's (``plan_precision``).

Example::

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "T4.csv"
    >>> rows = pd.DataFrame([{"device": "T4", "op": "fc", "kind": "linear",
    ...     "shape_key": "linear|32x64|w:16x64,16", "precision": "fp16", "phase": "forward",
    ...     "batch_size": 32, "numel": 0, "flops": 65536, "bytes": 6272, "time_us": 7.5,
    ...     "repeats": 20}])
    >>> write_profile(path, rows, {"torch_version": "2.13.0"})
    >>> table = read_profile(path)
    >>> table.source, table.metadata["torch_version"], table.op_time_us("T4", "fc", "fp16",
    ...     "forward", 32)
    ('profile:T4.csv', '2.13.0', 7.5)
"""

import io
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import pandas as pd

from qsync_lab.errors import QSyncError
from qsync_lab.io import atomic_write_text
from qsync_lab.limits import read_bounded_bytes
from qsync_lab.precision import Precision
from qsync_lab.tomlfile import show

__all__ = ["OP_PHASES", "PROFILE_COLUMNS", "PROFILE_PHASES", "ProfileTable", "read_profile",
           "write_profile"]

PROFILE_COLUMNS = ("device", "op", "kind", "shape_key", "precision", "plan_precision", "phase",
                   "batch_size", "numel", "flops", "bytes", "time_us", "repeats")
#: op phases, then the runtime's casts and the gradient compressors' encode and decode
#: (``kind`` "encode" or "decode", ``op`` the compression spec, e.g. "global_qsgd:8")
PROFILE_PHASES = ("forward", "backward_input", "backward_weight", "cast", "compress")
OP_PHASES = PROFILE_PHASES[:3]
_TEXT = ("device", "op", "kind", "shape_key", "precision", "plan_precision", "phase")
_SIGNED_KIND = "in_step"
_META_PREFIX = "#"


@dataclass(frozen=True, eq=False)
class ProfileTable:
    """One loaded profile: its rows, metadata and lookup indexes.

    Build with :meth:`from_frame` or :func:`read_profile`.

    Attributes:
        frame: the rows (columns :data:`PROFILE_COLUMNS`).
        source: ``"profile:<file name>"``, carried by every number taken from it.
        metadata: the ``# key: value`` lines.
        by_op: (device, op, plan precision, phase, batch_size) -> time_us.
        by_shape: (device, kind, shape_key, plan precision, phase) -> mean time_us.
    """

    frame: pd.DataFrame
    source: str
    metadata: Mapping[str, str] = field(default_factory=dict)
    by_op: Mapping[tuple, float] = field(default_factory=dict, repr=False)
    by_shape: Mapping[tuple, float] = field(default_factory=dict, repr=False)

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, source: str,
                   metadata: Mapping[str, str] | None = None) -> "ProfileTable":
        """Check ``frame`` and index it: by FQN the later of duplicate rows wins; by shape
        key, the mean over the rows of that key (ops of one kind and shapes, e.g. the
        layers of a transformer, timed in different places of a step)."""
        frame = _checked(frame, source)
        ops = frame[frame["phase"].isin(OP_PHASES)]
        by_op = {(d, o, p, ph, int(b)): float(t) for d, o, p, ph, b, t in zip(
            ops["device"], ops["op"], ops["plan_precision"], ops["phase"], ops["batch_size"],
            ops["time_us"]) if o}
        shaped = ops[ops["shape_key"] != ""]
        by_shape = {key: float(t) for key, t in shaped.groupby(
            ["device", "kind", "shape_key", "plan_precision", "phase"], sort=False)["time_us"]
            .mean().items()}
        return cls(frame, source, MappingProxyType(dict(metadata or {})),
                   MappingProxyType(by_op), MappingProxyType(by_shape))

    def op_time_us(self, device: str, op: str, precision: str, phase: str,
                   batch_size: int, shape_key: str | None = None) -> float | None:
        """The measured time of an op whose plan gives it ``precision``, by FQN and else by
        shape key; None if not measured."""
        found = self.by_op.get((device, op, precision, phase, batch_size))
        if found is None and shape_key is not None:
            kind = shape_key.split("|", 1)[0]
            found = self.by_shape.get((device, kind, shape_key, precision, phase))
        return found

    def aliased(self, alias: str, device: str) -> "ProfileTable":
        """This table plus a copy of ``device``'s rows under the device name ``alias``."""
        rows = self.frame[self.frame["device"] == device].assign(device=alias)
        return ProfileTable.from_frame(pd.concat([self.frame, rows], ignore_index=True),
                                       self.source, self.metadata)

    def casts(self) -> pd.DataFrame:
        """The cast rows, with ``src`` and ``dst`` columns split from ``precision``."""
        rows = self.frame[self.frame["phase"] == "cast"].copy()
        parts = rows["precision"].str.split("->", n=1, expand=True)
        rows["src"] = parts[0] if len(rows) else pd.Series(dtype=str)
        rows["dst"] = parts[1] if len(rows) else pd.Series(dtype=str)
        return rows


def read_profile(path: "str | os.PathLike[str]") -> ProfileTable:
    """Load a profile CSV (format in the module docstring).

    Raises:
        QSyncError: a missing file, a missing column or a bad value, in one line.
    """
    path = Path(path)
    try:
        text = read_bounded_bytes(path, f"profile {path}").decode("utf-8")
    except OSError as err:
        raise QSyncError(f"cannot read profile {path}: {err.strerror}; "
                         "give the path to a profile CSV") from None
    except UnicodeDecodeError:
        raise QSyncError(f"profile {path} is not UTF-8 text; give the path to a profile "
                         "CSV") from None
    lines = text.splitlines()
    meta_lines = [line for line in lines if line.startswith(_META_PREFIX)]
    body = "\n".join(line for line in lines if not line.startswith(_META_PREFIX))
    metadata = {}
    for line in meta_lines:
        key, sep, value = line.lstrip(_META_PREFIX).partition(":")
        if sep:
            metadata[key.strip()] = value.strip()
    try:
        frame = pd.read_csv(io.StringIO(body), keep_default_na=False,
                            dtype={c: str for c in _TEXT})
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise QSyncError(f"profile {path} is not a CSV: {str(err).splitlines()[0]}") from None
    return ProfileTable.from_frame(frame, f"profile:{path.name}", metadata)


def write_profile(path: "str | os.PathLike[str]", frame: pd.DataFrame,
                  metadata: Mapping[str, str] | None = None) -> None:
    """Write ``frame`` (columns :data:`PROFILE_COLUMNS`) with ``metadata`` lines, atomically."""
    frame = _checked(frame, str(path))
    header = "".join(f"{_META_PREFIX} {k}: {v}\n" for k, v in (metadata or {}).items())
    atomic_write_text(path, header + frame.to_csv(index=False, lineterminator="\n"))


def _checked(frame: pd.DataFrame, source: str) -> pd.DataFrame:
    if "plan_precision" not in frame.columns and "precision" in frame.columns:
        frame = frame.assign(plan_precision=frame["precision"])  # written before the column
    missing = [c for c in PROFILE_COLUMNS if c not in frame.columns]
    if missing:
        raise QSyncError(f"profile {source} lacks column {missing[0]!r}; "
                         f"a profile has columns {', '.join(PROFILE_COLUMNS)}")
    frame = frame.loc[:, list(PROFILE_COLUMNS)].copy()
    for col in _TEXT:
        frame[col] = frame[col].astype(str)
    for col in ("precision", "plan_precision"):
        frame[col] = frame[col].str.strip().str.lower()
    signed = frame["kind"] == _SIGNED_KIND  # a residual: may be negative
    for col in ("batch_size", "numel", "flops", "bytes", "time_us", "repeats"):
        values = pd.to_numeric(frame[col], errors="coerce")
        negative = (values < 0) & ~signed if col == "time_us" else values < 0
        bad = values.isna() | negative | (values.abs() == math.inf)
        if bad.any():
            row = int(values.index[bad][0])
            raise QSyncError(f"profile {source} row {row}: {col} must be a number >= 0 and "
                             f"finite, got {show(str(frame[col].iloc[row]))}")
        frame[col] = values
    bad_phase = ~frame["phase"].isin(PROFILE_PHASES)
    if bad_phase.any():
        row = int(frame.index[bad_phase][0])
        raise QSyncError(f"profile {source} row {row}: unknown phase "
                         f"{frame['phase'].iloc[row]!r}; use {', '.join(PROFILE_PHASES)}")
    for row, (phase, text, plan) in enumerate(zip(frame["phase"], frame["precision"],
                                                  frame["plan_precision"])):
        for name in text.split("->") + plan.split("->") if phase == "cast" else [text, plan]:
            try:
                Precision.parse(name)
            except QSyncError as err:
                raise QSyncError(f"profile {source} row {row}: {err}") from None
    return frame.reset_index(drop=True)
