"""``Cluster``: which device kind each data-parallel rank runs as, its batch, and the links
between ranks (:mod:`qsync_lab.cluster.load` reads one from TOML).

Example::

    >>> from qsync_lab.cluster import load_cluster
    >>> cluster = load_cluster("local-hybrid")
    >>> cluster.world_size, cluster.device_of(1).name, cluster.link_between(0, 1).name
    (2, 'T4', 'loopback')
"""

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import pandas as pd

from qsync_lab.cluster.render import cluster_summary, cluster_text
from qsync_lab.devices import DeviceCatalog, DeviceSpec, LinkSpec
from qsync_lab.errors import QSyncError

__all__ = ["Cluster", "RankSpec"]


@dataclass(frozen=True)
class RankSpec:
    """One data-parallel rank.

    Attributes:
        rank: global rank.
        node: node rank (index into ``Cluster.node_names``).
        local_rank: rank within its node.
        device: catalog name of the device kind it runs as.
        batch_size: per-rank batch size.
        emulate_on: ``"cpu"`` when the device is emulated on this machine's CPU, else None.
        gpu: the node's GPU index the rank runs on (None: its local rank's).
        sms: the multiprocessors of that GPU the rank runs on (None: all of them); its
            ``device`` is then the partition kind ``<kind>/<sms>sm``
            (:meth:`~qsync_lab.devices.DeviceSpec.partition`).
    """

    rank: int
    node: int
    local_rank: int
    device: str
    batch_size: int
    emulate_on: str | None
    gpu: int | None = None
    sms: int | None = None

    @property
    def gpu_index(self) -> int:
        """The node's GPU index the rank runs on: its group's ``gpu``, else its local rank."""
        return self.local_rank if self.gpu is None else self.gpu


@dataclass(frozen=True)
class Cluster:
    """A hybrid cluster as loaded by :func:`load_cluster`.

    Attributes:
        name: cluster name.
        description: one line for listings.
        ranks: every rank, in rank order.
        node_names: node names, in node-rank order.
        intra_node_links: the link inside each node, in node-rank order.
        inter_node_link: the link between nodes (None for a one-node cluster).
        catalog: the device catalog the device names refer to.
        source: where the cluster was read from (a file, or a plan that carries it).
        definition: the cluster's document as read (TOML tables as plain data): a plan
            carries it, so the plan can be moved to the machines it is for
            (:func:`cluster_from_definition`).
    """

    name: str
    description: str
    ranks: tuple[RankSpec, ...]
    node_names: tuple[str, ...]
    intra_node_links: tuple[LinkSpec, ...]
    inter_node_link: LinkSpec | None
    catalog: DeviceCatalog = field(repr=False)
    source: str
    definition: Mapping[str, object] = field(default_factory=dict, repr=False, compare=False)

    def fingerprint(self) -> str:
        """sha256 of the definition (canonical JSON): the same cluster wherever it is read.

        Example::

            >>> from qsync_lab.cluster import cluster_from_definition, load_cluster
            >>> a = load_cluster("local-hybrid")
            >>> a.fingerprint() == cluster_from_definition(a.definition).fingerprint()
            True
        """
        text = json.dumps(self.definition, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def device_kinds(self) -> tuple[str, ...]:
        """Distinct device names, in order of first rank."""
        return tuple(dict.fromkeys(r.device for r in self.ranks))

    @property
    def global_batch_size(self) -> int:
        """Sum of the per-rank batch sizes (samples per synchronous step)."""
        return sum(r.batch_size for r in self.ranks)

    def device_of(self, rank: int) -> DeviceSpec:
        """The device spec of ``rank``.

        Example::

            >>> from qsync_lab.cluster import load_cluster
            >>> load_cluster("local-hybrid").device_of(1).name
            'T4'
        """
        return self.catalog.device(self._rank(rank).device)

    def ring_links(self) -> list[LinkSpec]:
        """The links between ring neighbours (ranks in rank order, wrapping): the intra-node
        link of each node whose ranks neighbour each other, and the inter-node link once if
        the ring crosses nodes; a ring allreduce runs at the slowest of them.

        Example::

            >>> from qsync_lab.cluster import load_cluster
            >>> [link.name for link in load_cluster("qsync-paper").ring_links()]
            ['nvlink2', 'nvlink2', 'pcie3_x16', 'pcie3_x16', 'eth_100g']

        Raises:
            QSyncError: several nodes and no ``inter_node_link``.
        """
        nodes = [r.node for r in self.ranks]
        following = nodes[1:] + nodes[:1]
        links = [self.intra_node_links[node]
                 for node in sorted({a for a, b in zip(nodes, following) if a == b})]
        if any(a != b for a, b in zip(nodes, following)):
            if self.inter_node_link is None:
                raise QSyncError(f"cluster {self.name!r} has several nodes but no "
                                 "inter_node_link; set one")
            links.append(self.inter_node_link)
        return links

    def link_between(self, rank_a: int, rank_b: int) -> LinkSpec:
        """The intra-node link of their node if both ranks share one, else the inter-node link.

        Example::

            >>> from qsync_lab.cluster import load_cluster
            >>> load_cluster("qsync-paper").link_between(16, 17).name
            'pcie3_x16'
        """
        a, b = self._rank(rank_a), self._rank(rank_b)
        if a.node == b.node:
            return self.intra_node_links[a.node]
        if self.inter_node_link is None:
            raise QSyncError(
                f"cluster {self.name!r} has several nodes but no inter_node_link; set one"
            )
        return self.inter_node_link

    def ranks_frame(self) -> pd.DataFrame:
        """One row per rank: rank, node, node_name, local_rank, device, batch_size, emulate_on,
        gpu, sms.

        Example::

            >>> from qsync_lab.cluster import load_cluster
            >>> load_cluster("local-hybrid").ranks_frame()["device"].tolist()
            ['V100-SXM2-32GB', 'T4']
        """
        columns = list(RankSpec.__dataclass_fields__)
        frame = pd.DataFrame([vars(r) for r in self.ranks], columns=columns)
        frame.insert(2, "node_name", [self.node_names[r.node] for r in self.ranks])
        return frame

    def summary(self) -> pd.DataFrame:
        """One row per device kind, indexed by device name.

        Columns: ``ranks``, ``nodes``, ``emulated_ranks``, ``intra_node_links``,
        ``batch_size_per_rank`` (<NA> when the kind's ranks differ; see
        :meth:`ranks_frame`), ``batch_size_total``, ``batch_share`` (of the global batch),
        ``memory_gib``, ``fp32_tflops``, ``low_precision`` and ``low_precision_tflops``
        (the fastest precision other than fp32; missing for an fp32-only device),
        ``fp32_tflops_total``, ``low_precision_tflops_total``, ``precisions``.

        Example::

            >>> from qsync_lab.cluster import load_cluster
            >>> t4 = load_cluster("qsync-paper").summary().loc["T4"]
            >>> int(t4["ranks"]), t4["low_precision"], float(t4["low_precision_tflops"])
            (16, 'int8', 130.0)
        """
        return cluster_summary(self)

    def __str__(self) -> str:
        return cluster_text(self)

    def _rank(self, rank: int) -> RankSpec:
        if not 0 <= rank < self.world_size:
            raise QSyncError(
                f"rank {rank} is out of range for cluster {self.name!r}; "
                f"use 0..{self.world_size - 1}"
            )
        return self.ranks[rank]
