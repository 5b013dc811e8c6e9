"""A cluster with other rank counts or batch sizes per device kind, edited in its definition.

A kind's device groups keep their order: a new count fills them at their sizes, the last
one takes any ranks beyond (a larger count grows the kind's last group), and groups and
nodes left without ranks are dropped.

Example::

    >>> from qsync_lab.cluster import load_cluster
    >>> paper = load_cluster("qsync-paper")
    >>> small = reshape_cluster(paper, counts={"V100-SXM2-32GB": 12, "T4": 2})
    >>> small.node_names, kind_counts(small)
    (('v100-0', 'v100-1', 't4-0'), {'V100-SXM2-32GB': 12, 'T4': 2})
    >>> reshape_cluster(paper, counts=kind_counts(paper)) is paper
    True
"""

import copy
from collections.abc import Mapping

from qsync_lab.cluster import Cluster, cluster_from_definition
from qsync_lab.errors import QSyncError

__all__ = ["kind_batch_sizes", "kind_counts", "reshape_cluster"]


def kind_counts(cluster: Cluster) -> dict[str, int]:
    """Ranks per device kind, in the cluster's kind order."""
    return {kind: sum(r.device == kind for r in cluster.ranks) for kind in cluster.device_kinds}


def kind_batch_sizes(cluster: Cluster) -> dict[str, int]:
    """The per-rank batch size of each device kind whose ranks all have the same one."""
    sizes = {kind: {r.batch_size for r in cluster.ranks if r.device == kind}
             for kind in cluster.device_kinds}
    return {kind: found.pop() for kind, found in sizes.items() if len(found) == 1}


def reshape_cluster(cluster: Cluster, *, counts: Mapping[str, int] | None = None,
                    batch_sizes: Mapping[str, int] | None = None) -> Cluster:
    """``cluster`` with ``counts`` ranks and ``batch_sizes`` per rank for the kinds named
    (the others keep theirs); ``cluster`` itself when nothing changes.

    Raises:
        QSyncError: a kind the cluster does not have, a negative count or a batch size
            below 1, or no rank left.
    """
    counts, batch_sizes = dict(counts or {}), dict(batch_sizes or {})
    unknown = (set(counts) | set(batch_sizes)) - set(cluster.device_kinds)
    if unknown:
        raise QSyncError(f"cluster {cluster.name!r} has no device kind {sorted(unknown)[0]!r} "
                         f"(it has {', '.join(cluster.device_kinds)})")
    bad = {k: v for k, v in counts.items() if v < 0} | {k: v for k, v in batch_sizes.items()
                                                       if v < 1}
    if bad:
        kind, value = next(iter(bad.items()))
        raise QSyncError(f"{kind}: {value} is not a rank count (>= 0) or batch size (>= 1)")
    definition = copy.deepcopy(dict(cluster.definition))
    left = {**kind_counts(cluster), **counts}
    nodes = definition.get("node", [])
    groups = [(g, cluster.catalog.device(g["kind"]).name) for n in nodes for g in n["devices"]]
    for i, (group, kind) in enumerate(groups):
        last = all(other != kind for _, other in groups[i + 1:])
        count = left[kind] if last else min(group.get("count", 1), left[kind])
        if count != group.get("count", 1):
            group["count"] = count
        left[kind] -= count
        batch = batch_sizes.get(kind, group.get("batch_size", definition.get("batch_size")))
        if batch != group.get("batch_size", definition.get("batch_size")):
            group["batch_size"] = batch
    for node in nodes:
        node["devices"] = [g for g in node["devices"] if g.get("count", 1) > 0]
    definition["node"] = [n for n in nodes if n["devices"]]
    if definition == cluster.definition:
        return cluster
    if not definition["node"]:
        raise QSyncError("the cluster needs at least one rank; raise a device kind's count")
    definition["name"] = f"{cluster.name}-custom"
    return cluster_from_definition(definition, origin=f"cluster {definition['name']!r}",
                                   catalog=cluster.catalog)
