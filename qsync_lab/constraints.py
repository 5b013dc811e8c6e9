"""What an allocation must satisfy: per-kind memory budgets and a throughput floor.

The allocators plan under :class:`Constraints` and a :class:`~qsync_lab.plan.Plan` records
the ones it was made under (its ``constraints`` section), so that its report, the tuner and
``qsync-lab run`` show them and a re-plan can use them again.

Example::

    >>> from qsync_lab.cluster import load_cluster
    >>> c = Constraints(memory_gib={"T4": 8})
    >>> round(c.memory_budget_bytes(load_cluster("v100-t4-small"), "T4") / 2**30, 1)
    8.0
    >>> c.throughput_samples_per_s is None   # default: the fastest kind at fp32 sets the pace
    True
    >>> Constraints.from_dict(c.to_dict()) == c
    True
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from qsync_lab.cluster import Cluster
from qsync_lab.devices import BYTES_PER_GIB
from qsync_lab.errors import QSyncError
from qsync_lab.tomlfile import MAX_NUMBER, is_number, show

__all__ = ["Constraints"]

_KEYS = ("memory_gib", "throughput_samples_per_s")


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
        if not isinstance(self.memory_gib, Mapping):
            raise QSyncError(f"memory budgets must be a table of device kind -> GiB, got "
                             f"{show(self.memory_gib)}")
        bad = {k: v for k, v in self.memory_gib.items()
               if not (is_number(v) and 0 < v <= MAX_NUMBER)}
        if bad:
            kind, value = next(iter(bad.items()))
            raise QSyncError(f"memory budget for {kind} must be a positive number of GiB, "
                             f"got {show(value)}")
        target = self.throughput_samples_per_s
        if target is not None and not (is_number(target) and 0 < target <= MAX_NUMBER):
            raise QSyncError("the throughput constraint must be a positive number of "
                             f"samples/s, got {show(target)}")
        object.__setattr__(self, "memory_gib", MappingProxyType(
            {str(k): float(v) for k, v in self.memory_gib.items()}))

    def memory_budget_bytes(self, cluster: Cluster, kind: str) -> float:
        """The per-rank memory budget of ``kind`` (catalog name) on ``cluster``."""
        budgets = self.for_cluster(cluster).memory_gib
        if kind in budgets:
            return budgets[kind] * BYTES_PER_GIB
        return float(cluster.catalog.device(kind).memory_bytes)

    def for_cluster(self, cluster: Cluster) -> "Constraints":
        """These constraints with the budgets' device kinds by their catalog names, each a
        kind of ``cluster`` (what a plan records).

        Example::

            >>> from qsync_lab.cluster import load_cluster
            >>> Constraints({"t4": 8}).for_cluster(load_cluster("local-hybrid")).memory_gib
            mappingproxy({'T4': 8.0})
        """
        budgets = {cluster.catalog.device(name).name: gib
                   for name, gib in self.memory_gib.items()}
        unknown = set(budgets) - set(cluster.device_kinds)
        if unknown:
            raise QSyncError(f"memory budget for {sorted(unknown)[0]}, which cluster "
                             f"{cluster.name!r} does not have ({', '.join(cluster.device_kinds)})")
        return Constraints(budgets, self.throughput_samples_per_s)

    def describe(self, cluster: Cluster) -> str:
        """One line: each kind's budget (``device memory`` where none was given) and the
        throughput target.

        Example::

            >>> from qsync_lab.cluster import load_cluster
            >>> Constraints({"T4": 1}).describe(load_cluster("local-hybrid"))
            'memory V100-SXM2-32GB 32 GiB (device memory), T4 1 GiB; throughput: the fastest kind at fp32 sets the pace'
        """
        given = self.for_cluster(cluster).memory_gib
        budgets = []
        for kind in cluster.device_kinds:
            if kind in given:
                budgets.append(f"{kind} {given[kind]:g} GiB")
            else:
                gib = cluster.catalog.device(kind).memory_bytes / BYTES_PER_GIB
                budgets.append(f"{kind} {gib:.3g} GiB (device memory)")
        target = self.throughput_samples_per_s
        pace = (f"at least {target:g} samples/s" if target is not None
                else "the fastest kind at fp32 sets the pace")
        return f"memory {', '.join(budgets)}; throughput: {pace}"

    def to_dict(self) -> dict[str, Any]:
        """The plan file's ``constraints`` section (JSON data)."""
        return {"memory_gib": dict(self.memory_gib),
                "throughput_samples_per_s": self.throughput_samples_per_s}

    @classmethod
    def from_dict(cls, data: Any, origin: str = "constraints") -> "Constraints":
        """Read :meth:`to_dict`'s output, checked (one-line errors)."""
        if not isinstance(data, Mapping):
            raise QSyncError(f"{origin} must be a table, got {show(data)}")
        unknown = sorted(set(data) - set(_KEYS))
        if unknown:
            raise QSyncError(f"{origin}: unknown key {unknown[0]!r}; expected one of: "
                             f"{', '.join(_KEYS)}")
        try:
            return cls(data.get("memory_gib", {}), data.get("throughput_samples_per_s"))
        except QSyncError as err:
            raise QSyncError(f"{origin}: {err}") from None
