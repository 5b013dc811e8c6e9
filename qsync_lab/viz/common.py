"""What the figures share: one colour per precision, and which ranks a figure draws.

Example::

    >>> PRECISION_COLORS["fp16"]
    '#f58518'
"""

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from qsync_lab.errors import QSyncError

__all__ = ["PRECISION_COLORS", "rank_label", "selected_ranks"]

#: precision name -> colour, the same in every figure (timeline bars, precision map)
PRECISION_COLORS: Mapping[str, str] = MappingProxyType({
    "fp32": "#4c78a8", "tf32": "#72b7b2", "bf16": "#54a24b", "fp16": "#f58518",
    "int8": "#e45756", "fp8_e4m3": "#b279a2", "fp8_e5m2": "#9d755d",
})


def selected_ranks(sim, ranks: "list[int] | None") -> list[int]:
    """``ranks``, checked against the simulation's world size (default: the first rank of
    each class of ranks; the other ranks of a class look alike)."""
    if ranks is None:
        _, first = np.unique(sim.class_of_rank, return_index=True)
        return sorted(first.tolist())
    bad = [r for r in ranks if not 0 <= r < sim.world_size]
    if bad:
        raise QSyncError(f"rank {bad[0]} is out of range; use 0..{sim.world_size - 1}")
    return list(ranks)


def rank_label(sim, rank: int) -> str:
    """``"rank 1 (T4)"``."""
    return f"rank {rank} ({sim.rank_devices[rank]})"
