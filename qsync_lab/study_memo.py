"""What a :class:`~qsync_lab.study.Study` keeps between calls: the qsync
:class:`~qsync_lab.allocate.Allocator` of its current inputs, and itself on other clusters.

Example::

    >>> from qsync_lab.cluster import load_cluster
    >>> local = load_cluster("local-hybrid")
    >>> cluster_key(local) == cluster_key(load_cluster("local-hybrid"))
    True
    >>> kept_allocator(None, "prepared", local, "costs") is None
    True
"""

import copy

from qsync_lab.cluster import Cluster

__all__ = ["cluster_key", "cluster_variant", "current_allocator", "kept_allocator"]


def kept_allocator(kept, prepared, cluster: Cluster, costs):
    """``kept`` (an allocator or None) while it was made from this ``prepared`` graph,
    ``cluster`` and ``costs``, else None."""
    if kept is None or any(a is not b for a, b in zip(
            (kept.prepared, kept.cluster, kept.costs), (prepared, cluster, costs))):
        return None
    return kept


def current_allocator(kept, prepared, cluster: Cluster, costs, indicator, *, optimizer: str,
                      compression):
    """``kept`` while it was made from exactly these inputs, else a new
    :class:`~qsync_lab.allocate.Allocator` of them: a re-plan under new constraints reuses
    it."""
    from qsync_lab.allocate import Allocator

    kept = kept_allocator(kept, prepared, cluster, costs)
    if kept is None or kept.indicator is not indicator or (
            kept.optimizer, kept.compression) != (optimizer, compression):
        return Allocator(prepared, cluster, costs, indicator, optimizer=optimizer,
                         compression=compression)
    return kept


def cluster_key(cluster: Cluster) -> tuple:
    """What tells clusters apart for :meth:`Study.on_cluster
    <qsync_lab.study.Study.on_cluster>`: the definition, and the ranks (a plan's batch sizes
    change them, not the definition)."""
    return cluster.fingerprint(), cluster.ranks


def cluster_variant(variants: dict, study, cluster: Cluster):
    """``study`` on ``cluster``, from ``variants`` (cluster key -> study, ``study`` filed
    under its own), where it is made the first time: a shallow copy of ``study`` with that
    cluster and no allocator kept, sharing its model, traced and prepared graph, costs and
    indicators."""
    variants.setdefault(cluster_key(study.cluster), study)
    key = cluster_key(cluster)
    if key not in variants:
        study.prepared  # traced and prepared once, for every variant
        variants[key] = variant = copy.copy(study)
        variant.cluster, variant._kept_allocator = cluster, None
    return variants[key]
