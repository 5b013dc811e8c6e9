"""What an allocation must satisfy: per-kind memory budgets and a throughput floor.

Example::

    >>> from qsync_lab.cluster import load_cluster
    >>> c = Constraints(memory_gib={"T4": 8})
    >>> round(c.memory_budget_bytes(load_cluster("v100-t4-small"), "T4") / 2**30, 1)
    8.0
    >>> c.throughput_samples_per_s is None   # default: the fastest kind at fp32 sets the pace
    True
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

from qsync_lab.cluster import Cluster
from qsync_lab.devices import BYTES_PER_GIB
from qsync_lab.errors import QSyncError

__all__ = ["Constraints"]


@dataclass(frozen=True)
class Constraints:
    """Constraints of an allocation.

    Attributes:
        memory_gib: device kind -> per-rank memory budget in GiB (default: the device's
            memory from the catalog).
        throughput_samples_per_s: the least throughput the plan must reach (default:
            the iteration time of the cluster if every rank computed like the fastest
            device kind at full precision, i.e. the training GPUs set the pace).
    """

    memory_gib: Mapping[str, float] = field(default_factory=dict, hash=False)
    throughput_samples_per_s: float | None = None

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.memory_gib.items() if not v > 0}
        if bad:
            kind, value = next(iter(bad.items()))
            raise QSyncError(f"memory budget for {kind} must be a positive number of GiB, "
                             f"got {value}")
        if self.throughput_samples_per_s is not None and not self.throughput_samples_per_s > 0:
            raise QSyncError("the throughput constraint must be a positive number of "
                             f"samples/s, got {self.throughput_samples_per_s}")

    def memory_budget_bytes(self, cluster: Cluster, kind: str) -> float:
        """The per-rank memory budget of ``kind`` (catalog name) on ``cluster``."""
        budgets = {cluster.catalog.device(name).name: gib
                   for name, gib in self.memory_gib.items()}
        unknown = set(budgets) - set(cluster.device_kinds)
        if unknown:
            raise QSyncError(f"memory budget for {sorted(unknown)[0]}, which cluster "
                             f"{cluster.name!r} does not have ({', '.join(cluster.device_kinds)})")
        if kind in budgets:
            return budgets[kind] * BYTES_PER_GIB
        return float(cluster.catalog.device(kind).memory_bytes)
