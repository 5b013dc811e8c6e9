"""Hybrid clusters: which device each data-parallel rank runs on and how ranks are linked.

A cluster is a TOML file: a shipped one by name (``qsync-paper``, ``v100-t4-small``,
``local-cpu``, ``local-hybrid``) or the user's own by path. Ranks are numbered node by
node, device group by device group, as torchrun numbers them. A cluster has at most
:data:`~qsync_lab.limits.MAX_RANKS` ranks (counted before any is made) and per-rank batches
of at most :data:`~qsync_lab.limits.MAX_BATCH_SIZE`.

Example::

    >>> from qsync_lab.cluster import load_cluster
    >>> cluster = load_cluster("qsync-paper")
    >>> cluster.world_size, cluster.device_kinds, cluster.global_batch_size
    (32, ('V100-SXM2-32GB', 'T4'), 1024)
    >>> cluster.link_between(0, 1).name, cluster.link_between(0, 31).name
    ('nvlink2', 'eth_100g')
"""

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.resources.abc import Traversable
from types import MappingProxyType

import pandas as pd

from qsync_lab.devices import (
    BYTES_PER_GB,
    BYTES_PER_GIB,
    FLOPS_PER_TFLOPS,
    US_PER_SECOND,
    DeviceCatalog,
    DeviceSpec,
    LinkSpec,
    load_catalog,
    parse_link,
)
from qsync_lab.errors import QSyncError
from qsync_lab.limits import MAX_BATCH_SIZE, MAX_RANKS, check_json_data
from qsync_lab.precision import Precision
from qsync_lab.resources import data_file
from qsync_lab.tomlfile import TomlTable, read_toml

__all__ = ["Cluster", "RankSpec", "cluster_from_definition", "list_clusters", "load_cluster"]

EMULATION_TARGETS = ("cpu",)
_CLUSTER_KEYS = ("name", "description", "batch_size", "inter_node_link", "node")
_NODE_KEYS = ("name", "intra_node_link", "devices")
_GROUP_KEYS = ("kind", "count", "batch_size", "emulate_on", "sms", "gpu")
_MAX_GPUS_PER_NODE = 64
_LINK_EXPECTED = (
    "a link name from links.toml or an inline table {bandwidth_GBps = ..., latency_us = ...}"
)


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

            >>> load_cluster("local-hybrid").device_of(1).name
            'T4'
        """
        return self.catalog.device(self._rank(rank).device)

    def ring_links(self) -> list[LinkSpec]:
        """The links between ring neighbours (ranks in rank order, wrapping): the intra-node
        link of each node whose ranks neighbour each other, and the inter-node link once if
        the ring crosses nodes; a ring allreduce runs at the slowest of them.

        Example::

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
        ``fp32_tflops_total``,
        ``low_precision_tflops_total``, ``precisions``.

        Example::

            >>> t4 = load_cluster("qsync-paper").summary().loc["T4"]
            >>> int(t4["ranks"]), t4["low_precision"], float(t4["low_precision_tflops"])
            (16, 'int8', 130.0)
        """
        rows = [self._summary_row(kind) for kind in self.device_kinds]
        frame = pd.DataFrame(rows).set_index("device")
        frame["batch_size_per_rank"] = frame["batch_size_per_rank"].astype("Int64")
        return frame

    def __str__(self) -> str:
        nodes = "node" if len(self.node_names) == 1 else "nodes"
        head = (
            f"{self.name}: {self.world_size} ranks on {len(self.node_names)} {nodes}, "
            f"global batch {self.global_batch_size}"
        )
        if self.inter_node_link is not None:
            head += f", between nodes {_describe_link(self.inter_node_link)}"
        lines = [head]
        for device, row in self.summary().iterrows():
            batch = (
                "mixed batch sizes"
                if pd.isna(row.batch_size_per_rank)
                else f"batch {row.batch_size_per_rank}/rank"
            )
            line = (
                f"  {row.ranks} x {device} on {row.nodes} {'node' if row.nodes == 1 else 'nodes'}"
                f" ({row.intra_node_links}), {batch}, {row.memory_gib:g} GiB,"
                f" {row.fp32_tflops:g} TFLOPS fp32"
            )
            if isinstance(row.low_precision, str):
                line += f", {row.low_precision_tflops:g} TFLOPS {row.low_precision}"
            if row.emulated_ranks:
                line += f", {row.emulated_ranks} emulated on cpu"
            lines.append(line)
        return "\n".join(lines)

    def _rank(self, rank: int) -> RankSpec:
        if not 0 <= rank < self.world_size:
            raise QSyncError(
                f"rank {rank} is out of range for cluster {self.name!r}; "
                f"use 0..{self.world_size - 1}"
            )
        return self.ranks[rank]

    def _summary_row(self, kind: str) -> dict[str, object]:
        spec = self.catalog.device(kind)
        ranks = [r for r in self.ranks if r.device == kind]
        batch_sizes = {r.batch_size for r in ranks}
        batch_total = sum(r.batch_size for r in ranks)
        fp32_tflops = spec.peak_flops.get(Precision.FP32, math.nan) / FLOPS_PER_TFLOPS
        low_precision, low_tflops = _fastest_low_precision(spec)
        return {
            "device": kind,
            "ranks": len(ranks),
            "nodes": len({r.node for r in ranks}),
            "emulated_ranks": sum(r.emulate_on is not None for r in ranks),
            "intra_node_links": ", ".join(
                dict.fromkeys(self.intra_node_links[r.node].name for r in ranks)
            ),
            "batch_size_per_rank": batch_sizes.pop() if len(batch_sizes) == 1 else pd.NA,
            "batch_size_total": batch_total,
            "batch_share": batch_total / self.global_batch_size,
            "memory_gib": spec.memory_bytes / BYTES_PER_GIB,
            "fp32_tflops": fp32_tflops,
            "low_precision": low_precision,
            "low_precision_tflops": low_tflops,
            "fp32_tflops_total": fp32_tflops * len(ranks),
            "low_precision_tflops_total": low_tflops * len(ranks),
            "precisions": ", ".join(spec.precision_list),
        }


def list_clusters() -> list[str]:
    """Names of the shipped clusters.

    Example::

        >>> list_clusters()
        ['local-cpu', 'local-hybrid', 'one-gpu-hybrid', 'qsync-paper', 'v100-t4-small']
    """
    files = data_file("clusters").iterdir()
    return sorted(f.name.removesuffix(".toml") for f in files if f.name.endswith(".toml"))


def load_cluster(
    name_or_path: "str | os.PathLike[str]", *, catalog: DeviceCatalog | None = None
) -> Cluster:
    """Load a shipped cluster by name, or the user's own cluster TOML by path.

    Args:
        name_or_path: a name from :func:`list_clusters`, or a path (anything ending in
            ``.toml`` or containing a path separator is taken as a path).
        catalog: the device catalog to resolve device and link names in (default: the
            shipped one; pass ``load_catalog("my_devices.toml")`` for your own devices).

    Raises:
        QSyncError: one line naming the file and the dotted key that is wrong.

    Example::

        >>> cluster = load_cluster("local-hybrid")
        >>> [(r.rank, r.device, r.emulate_on) for r in cluster.ranks]
        [(0, 'V100-SXM2-32GB', 'cpu'), (1, 'T4', 'cpu')]
    """
    return _build(read_toml(_cluster_file(name_or_path)), catalog)


def cluster_from_definition(definition: Mapping[str, object], *, origin: str = "cluster",
                            catalog: DeviceCatalog | None = None) -> Cluster:
    """The cluster a :attr:`Cluster.definition` describes (errors name ``origin``).

    Example::

        >>> definition = {"name": "two", "batch_size": 8, "node": [{"name": "n0",
        ...     "intra_node_link": "pcie3_x16", "devices": [{"kind": "T4", "count": 2}]}]}
        >>> cluster_from_definition(definition).device_kinds
        ('T4',)
    """
    if not isinstance(definition, Mapping):
        raise QSyncError(f"{origin}: expected a cluster table, got {type(definition).__name__}")
    check_json_data(definition, origin)
    return _build(TomlTable(definition, origin), catalog)


def _build(document: TomlTable, catalog: DeviceCatalog | None) -> Cluster:
    catalog = catalog if catalog is not None else load_catalog()
    document.check_keys(_CLUSTER_KEYS)
    default_batch_size = document.positive_int("batch_size", None, maximum=MAX_BATCH_SIZE)
    node_tables = document.tables("node")
    if len(node_tables) > MAX_RANKS:
        raise document.error(f"{len(node_tables)} nodes, over the limit of {MAX_RANKS}", "node")
    ranks: list[RankSpec] = []
    node_names: list[str] = []
    intra_node_links: list[LinkSpec] = []
    partitions: dict[str, DeviceSpec] = {}
    for node, node_table in enumerate(node_tables):
        node_table.check_keys(_NODE_KEYS)
        node_name = node_table.string("name")
        if node_name in node_names:
            first = node_names.index(node_name)
            raise node_table.error(
                f"duplicate node name {node_name!r} (also node[{first}]); give each node its own",
                "name",
            )
        node_names.append(node_name)
        intra_node_links.append(_link(catalog, node_table, "intra_node_link"))
        local_rank = 0
        used_sms: dict[int, int] = {}
        for group in node_table.tables("devices"):
            device, count, batch_size, emulate_on = _device_group(
                catalog, group, default_batch_size
            )
            if len(ranks) + count > MAX_RANKS:  # before making a RankSpec per rank
                raise group.error(
                    f"{len(ranks) + count} ranks so far, over the limit of {MAX_RANKS}", "count"
                )
            sms, gpu = _partition(catalog, group, device, count, used_sms)
            if sms is not None:
                spec = catalog.device(device).partition(sms)
                partitions[spec.name] = spec
                device = spec.name
            for _ in range(count):
                ranks.append(RankSpec(len(ranks), node, local_rank, device, batch_size, emulate_on,
                                      gpu, sms))
                local_rank += 1
    if partitions:
        catalog = DeviceCatalog(MappingProxyType({**catalog.devices, **partitions}),
                                catalog.links)
    has_inter_link = "inter_node_link" in document.data or len(node_tables) > 1
    return Cluster(
        name=document.string("name"),
        description=document.string("description", ""),
        ranks=tuple(ranks),
        node_names=tuple(node_names),
        intra_node_links=tuple(intra_node_links),
        inter_node_link=_link(catalog, document, "inter_node_link") if has_inter_link else None,
        catalog=catalog,
        source=document.file,
        definition=_plain(document.data),
    )


def _plain(value):
    """A TOML document as JSON-ready data (tables as dicts, arrays as lists)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _cluster_file(name_or_path: "str | os.PathLike[str]") -> "Traversable | str | os.PathLike[str]":
    """The shipped cluster file called ``name_or_path``, or the user's path."""
    if isinstance(name_or_path, os.PathLike) or _looks_like_path(name_or_path):
        return name_or_path
    if name_or_path in list_clusters():
        return data_file("clusters", f"{name_or_path}.toml")
    raise QSyncError(
        f"unknown cluster {name_or_path!r}; choose one of: {', '.join(list_clusters())}, "
        "or give the path to your own cluster .toml file"
    )


def _looks_like_path(name: str) -> bool:
    return name.endswith(".toml") or "/" in name or os.sep in name


def _device_group(
    catalog: DeviceCatalog, group: TomlTable, default_batch_size: int | None
) -> tuple[str, int, int, str | None]:
    """``(device name, count, batch_size, emulate_on)`` of one ``devices`` entry."""
    group.check_keys(_GROUP_KEYS)
    kind = group.string("kind")
    try:
        device = catalog.device(kind).name
    except QSyncError as err:
        raise group.error(str(err), "kind") from None
    count = group.positive_int("count", 1, maximum=MAX_RANKS)
    batch_size = group.positive_int("batch_size", default_batch_size, maximum=MAX_BATCH_SIZE)
    if batch_size is None:
        raise group.error(
            "missing; set a positive integer here or a top-level batch_size", "batch_size"
        )
    expected_target = " or ".join(f'"{t}"' for t in EMULATION_TARGETS)
    emulate_on = group.value("emulate_on", expected_target, lambda v: v in EMULATION_TARGETS, None)
    return device, count, batch_size, emulate_on


def _partition(catalog: DeviceCatalog, group: TomlTable, device: str, count: int,
               used_sms: dict[int, int]) -> tuple[int | None, int | None]:
    """``(sms, gpu)`` of a group that runs on a share of one GPU (``sms``, and ``gpu``: the
    node's GPU index, default 0), else ``(None, None)``; ``used_sms`` counts each GPU's SMs
    taken so far on the node, and no GPU gives more than it has."""
    if "sms" not in group.data:
        if "gpu" in group.data:
            raise group.error("gpu applies to a group that runs on a share of a GPU; add "
                              "sms = N or drop it", "gpu")
        return None, None
    spec = catalog.device(device)
    if spec.sm_count is None:
        raise group.error(f"{spec.name} has no sm_count in the catalog, so it cannot be "
                          "partitioned; drop sms", "sms")
    sms = group.positive_int("sms", maximum=spec.sm_count)
    gpu = group.data.get("gpu", 0)
    if gpu != 0:  # 0, or a positive index
        gpu = group.positive_int("gpu", maximum=_MAX_GPUS_PER_NODE - 1)
    used_sms[gpu] = used_sms.get(gpu, 0) + sms * count
    if used_sms[gpu] > spec.sm_count:
        raise group.error(f"GPU {gpu} of this node would give {used_sms[gpu]} SMs to its ranks "
                          f"but a {spec.name} has {spec.sm_count}; give fewer sms or another "
                          "gpu", "sms")
    return sms, gpu


def _link(catalog: DeviceCatalog, table: TomlTable, name: str) -> LinkSpec:
    """The link named or written inline at ``table.<name>``."""
    value = table.value(name, _LINK_EXPECTED, lambda v: isinstance(v, str | Mapping))
    if isinstance(value, Mapping):
        return parse_link(table.table(name))
    try:
        return catalog.link(value)
    except QSyncError as err:
        raise table.error(str(err), name) from None


def _describe_link(link: LinkSpec) -> str:
    bandwidth_GBps = link.bandwidth_Bps / BYTES_PER_GB
    return f"{link.name} ({bandwidth_GBps:g} GB/s, {link.latency_s * US_PER_SECOND:g} us)"


def _fastest_low_precision(spec: DeviceSpec) -> tuple[str | None, float]:
    """The supported precision other than fp32 with the highest peak (first on ties)."""
    low = [p for p in spec.precision_list if p is not Precision.FP32]
    if not low:
        return None, math.nan
    best = max(low, key=lambda p: spec.peak_flops[p])
    return str(best), spec.peak_flops[best] / FLOPS_PER_TFLOPS
