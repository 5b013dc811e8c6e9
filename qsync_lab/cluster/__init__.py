"""Hybrid clusters: which device each data-parallel rank runs on and how ranks are linked.

A cluster is a TOML file: a shipped one by name or the user's own by path.

* :mod:`~qsync_lab.cluster.core`: :class:`Cluster` and :class:`RankSpec`;
* :mod:`~qsync_lab.cluster.load`: :func:`load_cluster`, :func:`list_clusters` and
  :func:`cluster_from_definition` (the definition a plan carries);
* :mod:`~qsync_lab.cluster.render`: the per-kind summary table and the text of a cluster.

Example::

    >>> cluster = load_cluster("v100-t4-small")
    >>> cluster.device_kinds, len(str(cluster).splitlines())
    (('V100-SXM2-32GB', 'T4'), 3)
"""

from qsync_lab.cluster.core import Cluster, RankSpec
from qsync_lab.cluster.load import cluster_from_definition, list_clusters, load_cluster

__all__ = ["Cluster", "RankSpec", "cluster_from_definition", "list_clusters", "load_cluster"]
