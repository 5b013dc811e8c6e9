"""Clusters read from TOML: a shipped one by name (``qsync-paper``, ``v100-t4-small``,
``local-cpu``, ``local-hybrid``) or the user's own by path, and the definition a plan
carries.

Ranks are numbered node by node, device group by device group, as torchrun numbers them.
A cluster has at most :data:`~qsync_lab.limits.MAX_RANKS` ranks (counted before any is
made) and per-rank batches of at most :data:`~qsync_lab.limits.MAX_BATCH_SIZE`; an error
names the file and the dotted key that is wrong, in one line.

Example::

    >>> cluster = load_cluster("qsync-paper")
    >>> cluster.world_size, cluster.device_kinds, cluster.global_batch_size
    (32, ('V100-SXM2-32GB', 'T4'), 1024)
    >>> cluster.link_between(0, 1).name, cluster.link_between(0, 31).name
    ('nvlink2', 'eth_100g')
"""

import os
from collections.abc import Mapping
from importlib.resources.abc import Traversable
from types import MappingProxyType

from qsync_lab.cluster.core import Cluster, RankSpec
from qsync_lab.devices import DeviceCatalog, DeviceSpec, LinkSpec, load_catalog, parse_link
from qsync_lab.errors import QSyncError
from qsync_lab.limits import MAX_BATCH_SIZE, MAX_RANKS, check_json_data
from qsync_lab.resources import data_file
from qsync_lab.tomlfile import TomlTable, read_toml

__all__ = ["cluster_from_definition", "list_clusters", "load_cluster"]

EMULATION_TARGETS = ("cpu",)
_CLUSTER_KEYS = ("name", "description", "batch_size", "inter_node_link", "node")
_NODE_KEYS = ("name", "intra_node_link", "devices")
_GROUP_KEYS = ("kind", "count", "batch_size", "emulate_on", "sms", "gpu")
_MAX_GPUS_PER_NODE = 64
_LINK_EXPECTED = (
    "a link name from links.toml or an inline table {bandwidth_GBps = ..., latency_us = ...}"
)


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

