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
time_us    median time of one run (on a GPU: the device's time, CUDA events)
repeats    how many timed runs the median is over
host_us    optional: median time the host spent issuing the run (a GPU's op rows: the host
           clock around the op's call, no synchronise); empty where the host and the
           device are one (CPU rows, casts) or it was not measured (profiles written
           before the column)
========== ==============================================================================

Metadata keys the profiler writes: ``torch_version``, ``cuda_version``, ``device_name``,
``qsync_lab_version``, ``date``. Rows match an op by (device, FQN, precision, phase,
batch size) first, then by (device, kind, shape key, precision, phase), the precision
being the plan's (``plan_precision``). Host times match the same way; an op without one
takes the median host time of its (device, kind, precision, phase), else of its (device,
precision, phase): issuing an op costs the host about the same whatever its sizes.

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
    >>> table.op_host_us("T4", "fc", "fp16", "forward", 32) is None   # no host_us column
    True
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
                   "batch_size", "numel", "flops", "bytes", "time_us", "repeats", "host_us")
#: columns a profile may lack (written before them), and what they then hold
_OPTIONAL = {"host_us": math.nan}
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
        by_shape: (device, kind, shape_key, plan precision, phase) -> median time_us.
        host_by_op, host_by_shape: the same for ``host_us`` (rows that have one).
        host_by_kind: (device, kind, plan precision, phase) and (device, plan precision,
            phase) -> median ``host_us``: the host time of ops without one.
    """

    frame: pd.DataFrame
    source: str
    metadata: Mapping[str, str] = field(default_factory=dict)
    by_op: Mapping[tuple, float] = field(default_factory=dict, repr=False)
    by_shape: Mapping[tuple, float] = field(default_factory=dict, repr=False)
    host_by_op: Mapping[tuple, float] = field(default_factory=dict, repr=False)
    host_by_shape: Mapping[tuple, float] = field(default_factory=dict, repr=False)
    host_by_kind: Mapping[tuple, float] = field(default_factory=dict, repr=False)

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, source: str,
                   metadata: Mapping[str, str] | None = None) -> "ProfileTable":
        """Check ``frame`` and index its op rows' times and host times (the attributes)."""
        frame = _checked(frame, source)
        ops = frame[frame["phase"].isin(OP_PHASES)]
        hosted = ops[ops["host_us"].notna()]
        return cls(frame, source, MappingProxyType(dict(metadata or {})),
                   *(MappingProxyType(index) for index in (*_indexes(ops, "time_us"),
                                                           *_indexes(hosted, "host_us"))),
                   MappingProxyType(_host_by_kind(hosted)))

    def op_time_us(self, device: str, op: str, precision: str, phase: str,
                   batch_size: int, shape_key: str | None = None) -> float | None:
        """The measured time of an op whose plan gives it ``precision``, by FQN and else by
        shape key; None if not measured."""
        found = self.by_op.get((device, op, precision, phase, batch_size))
        if found is None and shape_key is not None:
            kind = shape_key.split("|", 1)[0]
            found = self.by_shape.get((device, kind, shape_key, precision, phase))
        return found

    def op_host_us(self, device: str, op: str, precision: str, phase: str, batch_size: int,
                   shape_key: str | None = None) -> float | None:
        """The measured host time of an op (as :meth:`op_time_us` finds its time), else the
        median of its kind (``shape_key``'s), else of every kind at ``precision`` and
        ``phase`` on ``device``; None where the table has no host times there."""
        found = self.host_by_op.get((device, op, precision, phase, batch_size))
        if found is None and shape_key is not None:
            kind = shape_key.split("|", 1)[0]
            found = self.host_by_shape.get((device, kind, shape_key, precision, phase))
            if found is None:
                found = self.host_by_kind.get((device, kind, precision, phase))
        if found is None:
            found = self.host_by_kind.get((device, precision, phase))
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


def _indexes(ops: pd.DataFrame, column: str) -> tuple[dict, dict]:
    """``column`` of op rows by (device, FQN, plan precision, phase, batch size), the later
    of duplicate rows winning, and the median by (device, kind, shape key, plan precision,
    phase): ops of one kind and shapes, e.g. the layers of a transformer, timed in
    different places of a step, where one place can stall (a GPU's host waiting on a full
    launch queue, a garbage collection: one of BERT-base's twelve score matmuls took 50 ms
    of host time on an H200, its mean over the layers 4.3 ms, the median 0.16)."""
    by_op = {(d, o, p, ph, int(b)): float(t) for d, o, p, ph, b, t in zip(
        ops["device"], ops["op"], ops["plan_precision"], ops["phase"], ops["batch_size"],
        ops[column]) if o}
    shaped = ops[ops["shape_key"] != ""]
    by_shape = {key: float(t) for key, t in shaped.groupby(
        ["device", "kind", "shape_key", "plan_precision", "phase"], sort=False)[column]
        .median().items()}
    return by_op, by_shape


def _host_by_kind(hosted: pd.DataFrame) -> dict:
    """Median ``host_us`` per (device, kind, plan precision, phase) and per (device, plan
    precision, phase)."""
    found = {}
    for keys in (["device", "kind", "plan_precision", "phase"],
                 ["device", "plan_precision", "phase"]):
        found.update({key: float(t) for key, t in
                      hosted.groupby(keys, sort=False)["host_us"].median().items()})
    return found


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


def _named(source: str) -> str:
    """``profile:cpu.csv`` as an error names it: ``profile cpu.csv``."""
    return f"profile {source.removeprefix('profile:')}"


def _checked(frame: pd.DataFrame, source: str) -> pd.DataFrame:
    if "plan_precision" not in frame.columns and "precision" in frame.columns:
        frame = frame.assign(plan_precision=frame["precision"])  # written before the column
    frame = frame.assign(**{c: v for c, v in _OPTIONAL.items() if c not in frame.columns})
    missing = [c for c in PROFILE_COLUMNS if c not in frame.columns]
    if missing:
        raise QSyncError(f"{_named(source)} lacks column {missing[0]!r}; "
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
            raise QSyncError(f"{_named(source)}, data row {row + 1}: {col} must be a number "
                             f">= 0 and finite, got {show(str(frame[col].iloc[row]))}")
        frame[col] = values
    text = frame["host_us"].astype(object)
    empty = text.isna() | text.map(lambda v: str(v).strip() in ("", "nan"))  # not measured
    host = pd.to_numeric(text.where(~empty), errors="coerce")
    bad = (host.isna() & ~empty) | (host < 0) | (host.abs() == math.inf)
    if bad.any():
        row = int(host.index[bad][0])
        raise QSyncError(f"{_named(source)}, data row {row + 1}: host_us must be empty or a "
                         f"number >= 0 and finite, got {show(str(text.iloc[row]))}")
    frame["host_us"] = host
    bad_phase = ~frame["phase"].isin(PROFILE_PHASES)
    if bad_phase.any():
        row = int(frame.index[bad_phase][0])
        raise QSyncError(f"{_named(source)}, data row {row + 1}: unknown phase "
                         f"{frame['phase'].iloc[row]!r}; use {', '.join(PROFILE_PHASES)}")
    for row, (phase, text, plan) in enumerate(zip(frame["phase"], frame["precision"],
                                                  frame["plan_precision"])):
        for name in text.split("->") + plan.split("->") if phase == "cast" else [text, plan]:
            try:
                Precision.parse(name)
            except QSyncError as err:
                raise QSyncError(f"{_named(source)}, data row {row + 1}: {err}") from None
    return frame.reset_index(drop=True)
