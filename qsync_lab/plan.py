"""``Plan``: the frozen, versioned result of an allocation, as one JSON file.

A plan says, for one model on one cluster, which batch size every rank runs, how every
planned op computes on each device kind (forward and backward precision, rounding,
granularity: :class:`~qsync_lab.policy.OpPrecision`), which optimizer the run uses (the
memory model counts its state), how gradients are compressed, and what it was made under:
its strategy (with the optimizer and compression, its settings) and the constraints
(:class:`~qsync_lab.constraints.Constraints`: per-kind memory budgets, the throughput
target; ``None`` in a file written before plans recorded them). It carries the cluster's
definition, not a path, so it can be moved to the cluster it is for. It is written as
``{"_type": "qsync_lab.Plan", "_version": 2, "_data": {...}}`` (torchao's config
practice), atomically, and checked in full on load: every field's type and bounds (batch
sizes in 1..2**20, rank ids 0..world-1 in order, device kinds from the catalog, precisions
from the policy, compression from the registry, a model name that is never a path), the
file's size, depth and numbers (:mod:`qsync_lab.limits`), then against the model and the
cluster. The checks are hand-written, not a pydantic or msgspec schema: neither is a
dependency or installed (pydantic would also slow every command's start), and most checks
look names up in the catalog, policy, registry and zoo, which a schema leaves to custom
validators anyway. Every command and function that takes a plan takes this file; version-1
files are migrated on load (:class:`PlanMigrationWarning` says what was filled in).

Example::

    >>> import tempfile, pathlib
    >>> import torch, torch.nn as nn
    >>> from qsync_lab.cluster import load_cluster
    >>> from qsync_lab.graph import trace_graph
    >>> graph = trace_graph(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(2, 8))
    >>> plan = Plan.build(graph, load_cluster("local-hybrid"), {"T4": {"0": "fp16"}},
    ...                   strategy="manual", optimizer="adamw")
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "plan.json"
    >>> plan.save(path)
    >>> Plan.load(path, graph=graph) == plan
    True
    >>> str(plan.precisions["T4"]["0"]), plan.cluster.name, plan.optimizer
    ('fp16/fp16 nearest tensor', 'local-hybrid', 'adamw')
"""

import dataclasses
import functools
import json
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from qsync_lab.cluster import Cluster, cluster_from_definition, list_clusters, load_cluster
from qsync_lab.compress.spec import CompressionSettings
from qsync_lab.constraints import Constraints
from qsync_lab.errors import QSyncError
from qsync_lab.io import atomic_write_text
from qsync_lab.limits import (MAX_BATCH_SIZE, MAX_RANKS, check_json_data, loads_json,
                              read_bounded_bytes)
from qsync_lab.optimizers import OPTIMIZER_STATES
from qsync_lab.policy import KindPlan, OpPrecision
from qsync_lab.tomlfile import TomlTable, is_text, show

if TYPE_CHECKING:
    from qsync_lab.graph import OpGraph

__all__ = ["PLAN_TYPE", "SCHEMA_VERSION", "Plan", "PlanMigrationWarning", "RankPlan"]

PLAN_TYPE = "qsync_lab.Plan"
SCHEMA_VERSION = 2
_DOCUMENT_KEYS = ("_type", "_version", "_data")
_DATA_KEYS = ("model", "cluster", "ranks", "precisions", "optimizer", "compression",
              "strategy")
_OPTIONAL_DATA_KEYS = ("constraints",)  # absent in files written before plans recorded them
_MODEL_KEYS = ("name", "kwargs", "fingerprint")
_CLUSTER_KEYS = ("name", "sha256", "definition")
_RANK_KEYS = {"rank": "an integer", "device": "a device kind", "batch_size": "an integer"}
_V1_DATA_KEYS = ("model_fingerprint", "cluster", "ranks", "precisions", "gradient_compression",
                 "strategy", "model")
_V1_OPTIMIZER = "sgd_momentum"  # what a version-1 run trained with by default
MAX_TEXT_CHARS = 256  # a fingerprint, strategy, device kind or model name
MAX_MODEL_KWARGS = 1000  # values in a model's keyword arguments, nested ones included
#: a zoo model's name, or a function of the user's that builds one: ``package.module:function``
_MODEL_NAME = re.compile(r"[A-Za-z_]\w*(?:(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*)?", re.ASCII)


class PlanMigrationWarning(UserWarning):
    """A version-1 plan was read; the warning says what its version-2 form filled in."""


@dataclass(frozen=True)
class RankPlan:
    """What one rank runs: its device kind and batch size."""

    rank: int
    device: str
    batch_size: int

    def __post_init__(self) -> None:
        for name, least, most in (("rank", 0, MAX_RANKS - 1), ("batch_size", 1, MAX_BATCH_SIZE)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
                raise QSyncError(f"{name}: expected an integer in {least}..{most}, got "
                                 f"{show(value)}")
        _check_text("device", self.device)


@dataclass(frozen=True)
class Plan:
    """A quantization plan for one model on one cluster.

    Attributes:
        model_fingerprint: :meth:`OpGraph.fingerprint` of the model planned for.
        cluster_definition: the cluster's definition (:attr:`Cluster.definition`).
        ranks: per rank, its device kind and batch size (the plan may change batches).
        precisions: device kind -> {op FQN -> config}; ops left out follow the policy
            (:mod:`qsync_lab.policy`: fp32 for plannable kinds).
        optimizer: ``sgd``, ``sgd_momentum``, ``adam`` or ``adamw``: what the run trains
            with, and what the memory model counts.
        compression: gradient compression, parameter FQN pattern -> spec
            (:class:`~qsync_lab.compress.CompressionSettings`; empty: plain fp32 allreduce).
        strategy: which allocator made the plan.
        model_name: the zoo model planned for, if any (the runtime builds it from this).
        model_kwargs: the zoo model's keyword arguments.
        constraints: the memory budgets and throughput target the plan was made under
            (None: not recorded, a plan file from before they were). Not compared: plans
            that run the same are equal, whatever they were made under.
    """

    model_fingerprint: str
    cluster_definition: Mapping[str, Any] = field(hash=False, repr=False)
    ranks: tuple[RankPlan, ...]
    precisions: Mapping[str, Mapping[str, OpPrecision]] = field(hash=False)
    optimizer: str = "sgd_momentum"
    compression: Mapping[str, Any] = field(default_factory=dict, hash=False)
    strategy: str = ""
    model_name: str = ""
    model_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    constraints: Constraints | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _check_text("model fingerprint", self.model_fingerprint)
        if not 1 <= len(self.ranks) <= MAX_RANKS:
            raise QSyncError(f"the plan has {len(self.ranks)} ranks; a plan has 1..{MAX_RANKS}")
        for index, rank in enumerate(self.ranks):
            if rank.rank != index:
                raise QSyncError(f"ranks[{index}] has rank id {rank.rank}; rank ids run "
                                 f"0..{len(self.ranks) - 1} in order, each once")
        if not isinstance(self.optimizer, str) or self.optimizer not in OPTIMIZER_STATES:
            raise QSyncError(f"unknown optimizer {show(self.optimizer)}; choose one of: "
                             f"{', '.join(OPTIMIZER_STATES)}")
        CompressionSettings.parse(_thawed(self.compression))  # checked: one-line errors
        if not isinstance(self.strategy, str) or len(self.strategy) > MAX_TEXT_CHARS:
            raise QSyncError(f"strategy must be text of at most {MAX_TEXT_CHARS} characters, "
                             f"got {show(self.strategy)}")
        _check_model(self.model_name, self.model_kwargs)
        if self.constraints is not None and not isinstance(self.constraints, Constraints):
            raise QSyncError(f"constraints must be Constraints, got {show(self.constraints)}")

    @classmethod
    def build(cls, graph: "OpGraph", cluster: Cluster, precisions: Mapping[str, KindPlan], *,
              strategy: str = "", optimizer: str = "sgd_momentum",
              compression: "CompressionSettings | str | Mapping | None" = None,
              model_name: str = "", model_kwargs: Mapping[str, Any] | None = None,
              constraints: Constraints | None = None) -> "Plan":
        """A plan for ``graph`` on ``cluster`` (its batch sizes), checked against both.

        ``precisions`` may name device kinds by any catalog alias and give each op a
        precision name, an :class:`~qsync_lab.policy.OpPrecision` or its mapping; every
        cluster kind gets an entry (empty: all fp32). ``compression``: a spec for every
        parameter (``"global_qsgd:8"``) or a mapping pattern -> spec
        (:class:`~qsync_lab.compress.CompressionSettings`). ``model_name``/``model_kwargs``
        name the zoo model so that ``qsync-lab run`` can build it. ``constraints``: what the
        plan was made under (recorded with the catalog's names of the device kinds).
        """
        names = {cluster.catalog.device(kind).name: ops for kind, ops in precisions.items()}
        plan = cls(
            model_fingerprint=graph.fingerprint(),
            cluster_definition=_frozen_data(cluster.definition),
            ranks=tuple(RankPlan(r.rank, r.device, r.batch_size) for r in cluster.ranks),
            precisions=_frozen({kind: {fqn: OpPrecision.parse(p) for fqn, p in
                                       names.get(kind, {}).items()}
                                for kind in cluster.device_kinds}),
            optimizer=optimizer,
            compression=_frozen_data(CompressionSettings.parse(compression).to_dict()),
            strategy=strategy, model_name=model_name,
            model_kwargs=_frozen_data(model_kwargs or {}),
            constraints=None if constraints is None else constraints.for_cluster(cluster))
        plan.validate(graph, cluster)
        return plan

    def for_model(self, name: str, kwargs: Mapping[str, Any] | None = None) -> "Plan":
        """This plan, recording that it is for the zoo model ``name(**kwargs)``."""
        return dataclasses.replace(self, model_name=name, model_kwargs=_frozen_data(kwargs or {}))

    @functools.cached_property
    def cluster(self) -> Cluster:
        """The cluster the plan is for, with the plan's per-rank batch sizes."""
        return self.apply_to(cluster_from_definition(_thawed(self.cluster_definition),
                                                     origin="the plan's cluster"))

    @property
    def compression_settings(self) -> CompressionSettings:
        """The compression section as settings (empty: none)."""
        return CompressionSettings.parse(_thawed(self.compression))

    @property
    def cluster_name(self) -> str:
        return str(self.cluster_definition.get("name", ""))

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Per-rank batch sizes, in rank order."""
        return tuple(r.batch_size for r in self.ranks)

    def made_under(self) -> str:
        """One line: the strategy, its settings and the constraints the plan was made under.

        Example::

            >>> from qsync_lab.cluster import load_cluster
            >>> cluster = load_cluster("local-hybrid")
            >>> plan = Plan("abc", cluster.definition, (RankPlan(0, "V100-SXM2-32GB", 16),
            ...             RankPlan(1, "T4", 16)), {}, strategy="qsync",
            ...             constraints=Constraints({"T4": 1}))
            >>> plan.made_under()  # doctest: +ELLIPSIS
            'qsync (optimizer sgd_momentum, compression none) under memory V100-SXM2-32GB ... (device memory), T4 1 GiB; throughput: ...'
            >>> dataclasses.replace(plan, constraints=None).made_under()  # doctest: +ELLIPSIS
            'qsync (...) under constraints not recorded (a plan file from before ...'
        """
        compression = self.compression_settings
        strategy = (f"{self.strategy or 'a manual plan'} (optimizer {self.optimizer}, "
                    f"compression {compression})")
        if self.constraints is None:
            return (f"{strategy} under constraints not recorded (a plan file from before "
                    "plans recorded them; re-plan to record them)")
        return f"{strategy} under {self.constraints.describe(self.cluster)}"

    def low_precision_ops(self) -> dict[str, int]:
        """Per device kind, how many ops the plan runs in a precision other than fp32."""
        return {kind: sum(not cfg.is_fp32 for cfg in ops.values())
                for kind, ops in self.precisions.items()}

    def apply_to(self, cluster: Cluster) -> Cluster:
        """``cluster`` with this plan's per-rank batch sizes (checked first).

        Example::

            >>> from qsync_lab.cluster import load_cluster
            >>> cluster = load_cluster("local-hybrid")
            >>> plan = Plan("abc", cluster.definition, (RankPlan(0, "V100-SXM2-32GB", 20),
            ...             RankPlan(1, "T4", 12)), {})
            >>> [r.batch_size for r in plan.apply_to(cluster).ranks]
            [20, 12]
        """
        self._check_cluster(cluster)
        ranks = tuple(dataclasses.replace(r, batch_size=p.batch_size)
                      for r, p in zip(cluster.ranks, self.ranks))
        return dataclasses.replace(cluster, ranks=ranks)

    def validate(self, graph: "OpGraph | None" = None, cluster: Cluster | None = None) -> None:
        """Check the plan against a model and a cluster (default: its own).

        Raises:
            QSyncError: another model, a world size or device list that does not match,
                an unknown op FQN or a precision an op or device cannot run, in one line.
        """
        cluster = cluster if cluster is not None else self.cluster
        self._check_cluster(cluster)
        if self.constraints is not None:
            self.constraints.for_cluster(cluster)  # its budgets are for this cluster's kinds
        for kind, ops in self.precisions.items():
            device = cluster.catalog.device(kind)
            for fqn, cfg in ops.items():
                for precision in (cfg.forward, cfg.backward_precision):
                    if not device.supports(precision):
                        raise QSyncError(f"plan for {kind}: op {fqn!r}: {kind} cannot run "
                                         f"{precision}; re-plan for this cluster")
        if graph is None:
            return
        fingerprint = graph.fingerprint()
        if fingerprint != self.model_fingerprint:
            raise QSyncError(f"the plan was made for another model (fingerprint "
                             f"{self.model_fingerprint}, this model's is {fingerprint}); "
                             "re-plan for this model with `qsync-lab plan`")
        from qsync_lab.costs import op_work
        from qsync_lab.policy import validate_plan

        validate_plan(self.precisions, op_work(graph), cluster.device_kinds, cluster.catalog)
        unknown = [pattern for pattern, _ in self.compression_settings.rules
                   if pattern != "_default" and not pattern.startswith("re:")
                   and pattern not in graph.params.index]
        if unknown:
            raise QSyncError(f"the plan compresses parameter {unknown[0]!r}, which the model "
                             "does not have; name parameters as model.named_parameters() does")

    def to_dict(self) -> dict[str, Any]:
        """The versioned JSON document as plain Python objects."""
        return {"_type": PLAN_TYPE, "_version": SCHEMA_VERSION, "_data": {
            "model": {"name": self.model_name, "kwargs": _thawed(self.model_kwargs),
                      "fingerprint": self.model_fingerprint},
            "cluster": {"name": self.cluster_name,
                        "sha256": self.cluster.fingerprint(),
                        "definition": _thawed(self.cluster_definition)},
            "ranks": [{"rank": r.rank, "device": r.device, "batch_size": r.batch_size}
                      for r in self.ranks],
            "precisions": {kind: {fqn: cfg.to_dict() for fqn, cfg in ops.items()}
                           for kind, ops in self.precisions.items()},
            "optimizer": self.optimizer,
            "compression": _thawed(self.compression),
            "strategy": self.strategy,
            "constraints": None if self.constraints is None else self.constraints.to_dict(),
        }}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, document: Any, *, origin: str = "plan") -> "Plan":
        """Rebuild a plan from :meth:`to_dict`'s output, or migrate a version-1 document,
        checked in full: types and bounds of every field, its cluster, the ranks and
        precisions against that cluster.

        Raises:
            QSyncError: not a plan, a newer schema, or a malformed field, in one line.
        """
        if not isinstance(document, dict) or document.get("_type") != PLAN_TYPE:
            found = document.get("_type") if isinstance(document, dict) else type(document)
            raise QSyncError(f"{origin} is not a qsync_lab plan (_type {show(found)}, expected "
                             f"{PLAN_TYPE!r}); write it with `qsync-lab plan` or Plan.save")
        version = document.get("_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise QSyncError(f"{origin} has an invalid _version {show(version)}; expected an "
                             "integer >= 1")
        if version > SCHEMA_VERSION:
            raise QSyncError(f"{origin} has plan schema version {version}, newer than this "
                             f"qsync_lab's ({SCHEMA_VERSION}); upgrade qsync_lab")
        if not isinstance(document.get("_data"), dict):
            raise QSyncError(f"{origin} lacks its _data table; write it with Plan.save")
        check_json_data(document, origin)
        TomlTable(document, origin).check_keys(_DOCUMENT_KEYS)
        data = TomlTable(document["_data"], origin, "_data")
        if version == 1:
            data = TomlTable(_migrated_v1(data), origin, "_data")
        missing = [k for k in _DATA_KEYS if k not in data.data]
        if missing:
            raise QSyncError(f"{origin} lacks _data.{missing[0]}; write it with Plan.save")
        data.check_keys(_DATA_KEYS + _OPTIONAL_DATA_KEYS)
        model, cluster = data.table("model"), data.table("cluster")
        model.check_keys(_MODEL_KEYS)
        cluster.check_keys(_CLUSTER_KEYS)
        fields = dict(
            model_fingerprint=model.string("fingerprint"),
            cluster_definition=_frozen_data(cluster.table("definition").data),
            ranks=_read_ranks(data), precisions=_read_precisions(data.table("precisions")),
            optimizer=data.value("optimizer", "text", _is_str),
            strategy=data.value("strategy", "text", _is_str),
            model_name=model.value("name", "text", _is_str, ""),
            model_kwargs=_frozen_data(model.table("kwargs", {}).data),
            constraints=_read_constraints(data))
        cluster.value("name", "text", _is_str, "")  # the definition's name is the one used
        sha256 = cluster.value("sha256", "a sha256 hex digest", is_text, None)
        try:
            compression = CompressionSettings.parse(data.data["compression"]).to_dict()
            plan = cls(compression=_frozen_data(compression), **fields)
            if sha256 is not None and sha256 != plan.cluster.fingerprint():
                raise QSyncError("its cluster definition does not match its sha256 (the file "
                                 "was edited or damaged); re-plan")
            plan.validate()
        except QSyncError as err:
            raise QSyncError(f"{origin}: {err}") from None
        return plan

    def save(self, path: "str | os.PathLike[str]") -> None:
        """Write the plan as JSON, atomically."""
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: "str | os.PathLike[str]", *, graph: "OpGraph | None" = None,
             cluster: Cluster | None = None) -> "Plan":
        """Read a plan (at most :data:`~qsync_lab.limits.MAX_FILE_BYTES`, strict JSON),
        check it in full (:meth:`from_dict`) and against ``graph`` and ``cluster``.

        Raises:
            QSyncError: unreadable or malformed file, or see :meth:`validate`.
        """
        origin = f"plan {path}"
        try:
            text = read_bounded_bytes(path, origin).decode("utf-8")
        except (OSError, UnicodeDecodeError) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise QSyncError(f"cannot read plan {path}: {first}") from None
        plan = cls.from_dict(loads_json(text, origin), origin=origin)
        if graph is not None or cluster is not None:
            plan.validate(graph, cluster)
        return plan

    def _check_cluster(self, cluster: Cluster) -> None:
        if cluster.world_size != self.world_size:
            raise QSyncError(f"the plan is for {self.world_size} ranks, cluster "
                             f"{cluster.name!r} has {cluster.world_size}; re-plan for this "
                             "cluster")
        for rank, planned in zip(cluster.ranks, self.ranks):
            if cluster.catalog.device(rank.device).name != planned.device:
                raise QSyncError(f"the plan runs rank {planned.rank} as {planned.device}, "
                                 f"cluster {cluster.name!r} has a {rank.device} there; "
                                 "re-plan for this cluster")
        unknown = set(self.precisions) - set(cluster.device_kinds)
        if unknown:
            raise QSyncError(f"the plan has device kind {sorted(unknown)[0]!r}, which cluster "
                             f"{cluster.name!r} does not have; re-plan for this cluster")


def _read_ranks(data: TomlTable) -> tuple[RankPlan, ...]:
    """``_data.ranks``: each entry's fields present and in bounds."""
    tables = data.tables("ranks")
    if len(tables) > MAX_RANKS:
        raise data.error(f"{len(tables)} entries, over the limit of {MAX_RANKS} ranks", "ranks")
    ranks = []
    for table in tables:
        table.check_keys(_RANK_KEYS)
        values = {key: table.value(key, expected, _is_any) for key, expected in _RANK_KEYS.items()}
        try:
            ranks.append(RankPlan(**values))
        except QSyncError as err:
            raise table.error(str(err)) from None
    return tuple(ranks)


def _read_constraints(data: TomlTable) -> Constraints | None:
    """``_data.constraints``: None when absent or null (an older plan), else checked."""
    found = data.data.get("constraints")
    return None if found is None else Constraints.from_dict(found, data.where("constraints"))


def _read_precisions(kinds: TomlTable) -> Mapping[str, Mapping[str, OpPrecision]]:
    """``_data.precisions``: device kind -> {op FQN -> config}, each config parsed."""
    parsed: dict[str, dict[str, OpPrecision]] = {}
    for kind, ops in kinds.subtables().items():
        parsed[kind] = {}
        for fqn, cfg in ops.data.items():
            try:
                parsed[kind][fqn] = OpPrecision.parse(cfg)
            except QSyncError as err:
                raise ops.error(str(err), fqn) from None
    return _frozen(parsed)


def _migrated_v1(data: TomlTable) -> dict:
    """A version-1 ``_data`` in version-2 form (the cluster read from its file or by name)."""
    data.check_keys(_V1_DATA_KEYS)
    cluster = data.table("cluster")
    cluster.check_keys(("name", "source"))
    name, source = cluster.string("name"), cluster.string("source")
    model = data.table("model", {"name": "", "kwargs": {}})
    migrated = {
        "model": {**model.data, "fingerprint": data.value("model_fingerprint", "text", _is_any)},
        "cluster": {"name": name, "definition": _v1_cluster_definition(cluster, name, source)},
        "ranks": data.value("ranks", "a list of ranks", _is_any),
        "precisions": data.value("precisions", "a table of device kinds", _is_any),
        "optimizer": _V1_OPTIMIZER,
        "compression": data.value("gradient_compression", "a table", _is_any),
        "strategy": data.value("strategy", "text", _is_any),
    }
    warnings.warn(f"{data.file} is a version-1 plan: read as version 2 with the cluster of "
                  f"{source}, default backward precisions and optimizer {_V1_OPTIMIZER!r}; "
                  "save it again to keep the version-2 form", PlanMigrationWarning, stacklevel=4)
    return migrated


def _v1_cluster_definition(cluster: TomlTable, name: str, source: str) -> dict:
    """A version-1 plan's cluster: its ``source`` if that is a regular ``.toml`` file (not
    a symlink), else the shipped cluster ``name``."""
    path = Path(source)
    try:
        is_link, exists = path.is_symlink(), path.exists()
    except (OSError, ValueError) as err:  # a name too long, a NUL byte
        raise cluster.error(f"cannot use {show(source)} ({err}); re-plan", "source") from None
    if is_link:
        raise cluster.error(f"{source} is a symlink; point source at the cluster file itself "
                            "or re-plan", "source")
    if exists:
        if path.suffix != ".toml" or not path.is_file():
            raise cluster.error(f"{source} is not a cluster .toml file; re-plan", "source")
        return dict(load_cluster(path).definition)
    if name in list_clusters():
        return dict(load_cluster(name).definition)
    raise QSyncError(f"{cluster.file} is a version-1 plan whose cluster file {source} is gone "
                     f"and {name!r} is not a shipped cluster; re-plan")


def _check_model(name: Any, kwargs: Any) -> None:
    """The model's name has the form of a zoo name (an identifier), of a ``module:function``
    spec or is empty: never a path. Its arguments are plain JSON data of bounded size.

    Which zoo models exist, and which arguments they take, is checked where the model is
    built (:func:`qsync_lab.runtime.launch.check_run`), so that loading a plan needs no torch.
    """
    if not isinstance(name, str) or len(name) > MAX_TEXT_CHARS:
        raise QSyncError(f"model name must be text of at most {MAX_TEXT_CHARS} characters, "
                         f"got {show(name)}")
    if name and not _MODEL_NAME.fullmatch(name):
        raise QSyncError(f"model {show(name)} is neither a zoo model name nor a "
                         "module:function spec such as mypkg.models:build (letters, digits, _ "
                         "and dots only); re-plan with `qsync-lab plan --model`")
    if not isinstance(kwargs, Mapping):
        raise QSyncError(f"model kwargs must be a table, got {show(kwargs)}")
    check_json_data(_thawed(kwargs), "model kwargs", max_items=MAX_MODEL_KWARGS)


def _check_text(what: str, value: Any) -> None:
    if not is_text(value) or len(value) > MAX_TEXT_CHARS:
        raise QSyncError(f"{what} must be non-empty text of at most {MAX_TEXT_CHARS} "
                         f"characters, got {show(value)}")


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_any(value: Any) -> bool:
    return True


def _frozen(mapping: Mapping[str, Mapping]) -> Mapping[str, Mapping]:
    return MappingProxyType({k: MappingProxyType(dict(v)) for k, v in mapping.items()})


def _frozen_data(value: Any) -> Any:
    """JSON-like data made read-only (mappings as mapping proxies, lists as tuples)."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): _frozen_data(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_frozen_data(v) for v in value)
    return value


def _thawed(value: Any) -> Any:
    """The inverse of :func:`_frozen_data`: plain dicts and lists for JSON."""
    if isinstance(value, Mapping):
        return {k: _thawed(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value
