"""``SimResult``: the simulated iteration, as frames and as a Chrome/Perfetto trace.

Ranks of one class (same device kind, batch size and plan) share one compute timeline,
so a result stores one timeline per class and expands the per-rank event frame only
when :attr:`SimResult.events` is first read.

Trace format (:meth:`SimResult.to_perfetto`, :meth:`SimResult.write_perfetto`):
``{"traceEvents": [...], "displayTimeUnit": "ms"}`` with ``ph: "X"`` events whose ``ts``
and ``dur`` are microseconds, ``pid`` = rank, ``tid`` = 0 for the compute stream and 1
for the communication stream, ``ph: "M"`` metadata naming each process (``rank 3 (T4)``)
and thread, and ``args`` holding ``fqn``, ``precision``, ``plan_precision``, ``phase``,
``bytes`` and ``source``. Open it in https://ui.perfetto.dev or ``chrome://tracing``.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.cluster import load_cluster
    >>> from qsync_lab.costs import CostModel
    >>> from qsync_lab.graph import trace_graph
    >>> from qsync_lab.simulate import simulate
    >>> graph = trace_graph(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(2, 8))
    >>> sim = simulate(graph, {}, load_cluster("local-hybrid"), CostModel())
    >>> sim.rank_summary().columns.tolist()
    ['device', 'batch_size', 'busy_us', 'idle_us', 'tensor_peak_gib', 'wire_mib']
    >>> trace = sim.to_perfetto()
    >>> trace["displayTimeUnit"], sorted({e["ph"] for e in trace["traceEvents"]})
    ('ms', ['M', 'X'])
    >>> sim  # doctest: +ELLIPSIS
    SimResult(2 ranks: 1 x V100-SXM2-32GB, 1 x T4; iteration ... ms, ... samples/s, ...)
"""

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

import numpy as np
import pandas as pd

from qsync_lab.io import atomic_write_text
from qsync_lab.simulate.events import EVENT_COLUMNS, StreamEvents

__all__ = ["STREAMS", "SimResult"]

#: stream name -> Perfetto thread id
STREAMS: Mapping[str, int] = MappingProxyType({"compute": 0, "comm": 1})


@dataclass(frozen=True, eq=False)
class SimResult:
    """One simulated training iteration of a hybrid data-parallel cluster.

    Attributes:
        iteration_us: time from the first forward op to the last optimizer step.
        idle_us: per rank, the time its compute stream waits (iteration minus busy time).
        tensor_peak_bytes: per rank, the sum of ``memory_breakdown``'s components.
        memory_breakdown: per rank (rows), bytes per memory component (columns).
        memory_budget_bytes: per rank, the memory budget of the plan's constraints (its
            device's memory where the plan records none).
        wire_bytes: per rank, bytes it sends per iteration (ring allreduce).
        throughput_samples_per_s: global batch / iteration time.
        rank_devices: device kind per rank.
        rank_batch_sizes: batch size per rank.
        class_of_rank: per rank, the index of its compute timeline in ``compute``.
        compute: one compute stream per rank class (optimizer step included).
        comm: the communication stream, identical on every rank (empty for one rank).
    """

    iteration_us: float
    idle_us: pd.Series
    tensor_peak_bytes: pd.Series
    memory_breakdown: pd.DataFrame
    memory_budget_bytes: pd.Series
    wire_bytes: pd.Series
    throughput_samples_per_s: float
    rank_devices: tuple[str, ...]
    rank_batch_sizes: tuple[int, ...]
    class_of_rank: np.ndarray
    compute: tuple[StreamEvents, ...]
    comm: StreamEvents

    @property
    def world_size(self) -> int:
        return len(self.rank_devices)

    @cached_property
    def events(self) -> pd.DataFrame:
        """Every event of every rank: columns :data:`EVENT_COLUMNS`, sorted by rank,
        stream and start (built on first access)."""
        return self._frame(np.arange(self.world_size))

    def rank_events(self, rank: int) -> pd.DataFrame:
        """The events of one rank (without building the whole frame)."""
        return self._frame(np.array([rank]))

    def rank_summary(self) -> pd.DataFrame:
        """One row per rank: device, batch_size, busy_us, idle_us, tensor_peak_gib,
        wire_mib."""
        busy = np.array([s.dur_us.sum() for s in self.compute])[self.class_of_rank]
        return pd.DataFrame({
            "device": self.rank_devices, "batch_size": self.rank_batch_sizes,
            "busy_us": busy, "idle_us": self.idle_us.to_numpy(),
            "tensor_peak_gib": self.tensor_peak_bytes.to_numpy() / 2**30,
            "wire_mib": self.wire_bytes.to_numpy() / 2**20,
        }, index=pd.Index(range(self.world_size), name="rank"))

    def __repr__(self) -> str:
        counts = pd.Series(self.rank_devices).value_counts(sort=False)
        ranks = ", ".join(f"{n} x {kind}" for kind, n in counts.items())
        return (f"SimResult({self.world_size} ranks: {ranks}; iteration "
                f"{self.iteration_us / 1e3:.3f} ms, {self.throughput_samples_per_s:.1f} "
                f"samples/s, tensor peak {self.tensor_peak_bytes.max() / 2**20:.1f} MiB)")

    def write_perfetto(self, path: "str | os.PathLike[str]", *,
                       ranks: "list[int] | None" = None) -> None:
        """Write :meth:`to_perfetto`'s trace to ``path`` as JSON, atomically."""
        atomic_write_text(path, json.dumps(self.to_perfetto(ranks=ranks)))

    def to_perfetto(self, *, ranks: "list[int] | None" = None) -> dict:
        """The Chrome/Perfetto trace (format in the module docstring).

        Args:
            ranks: the ranks to include (default all; one class's ranks look alike).
        """
        selected = np.arange(self.world_size) if ranks is None else np.asarray(ranks)
        frame = self._frame(selected)
        trace_events: list[dict] = []
        for rank in selected.tolist():
            trace_events.append(_meta("process_name", rank, 0,
                                      f"rank {rank} ({self.rank_devices[rank]})"))
            trace_events.append({"name": "process_sort_index", "ph": "M", "pid": rank,
                                 "tid": 0, "args": {"sort_index": rank}})
            for stream, tid in STREAMS.items():
                trace_events.append(_meta("thread_name", rank, tid, stream))
        columns = {c: frame[c].tolist() for c in EVENT_COLUMNS}
        for i in range(len(frame)):
            trace_events.append({
                "name": columns["op"][i], "cat": columns["category"][i], "ph": "X",
                "ts": columns["start_us"][i], "dur": columns["dur_us"][i],
                "pid": columns["rank"][i], "tid": STREAMS[columns["stream"][i]],
                "args": {"fqn": columns["fqn"][i], "precision": columns["precision"][i],
                         "plan_precision": columns["plan_precision"][i],
                         "phase": columns["phase"][i], "bytes": columns["bytes"][i],
                         "source": columns["source"][i]},
            })
        return {"traceEvents": trace_events, "displayTimeUnit": "ms"}

    def _frame(self, ranks: np.ndarray) -> pd.DataFrame:
        parts = []
        for c, stream in enumerate(self.compute):
            members = ranks[self.class_of_rank[ranks] == c]
            if len(members):
                parts.append(_tiled(stream.to_frame(rank=0, stream="compute"), members))
        if len(self.comm) and len(ranks):
            parts.append(_tiled(self.comm.to_frame(rank=0, stream="comm"), ranks))
        if not parts:
            return pd.DataFrame(columns=list(EVENT_COLUMNS))
        frame = pd.concat(parts, ignore_index=True)
        order = np.lexsort((frame["start_us"].to_numpy(),
                            frame["stream"].map(STREAMS).to_numpy(),
                            frame["rank"].to_numpy()))
        return frame.iloc[order].reset_index(drop=True)


def _tiled(frame: pd.DataFrame, ranks: np.ndarray) -> pd.DataFrame:
    """``frame`` repeated once per rank, with the ``rank`` column set."""
    tiled = frame.iloc[np.tile(np.arange(len(frame)), len(ranks))].reset_index(drop=True)
    tiled["rank"] = np.repeat(ranks, len(frame))
    return tiled


def _meta(name: str, pid: int, tid: int, value: str) -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {"name": value}}
