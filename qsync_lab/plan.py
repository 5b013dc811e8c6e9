"""``Plan``: the frozen, versioned result of an allocation, as one JSON file.

A plan says, for one model on one cluster, which batch size every rank runs, how every
planned op computes on each device kind (forward and backward precision, rounding,
granularity: :class:`~qsync_lab.policy.OpPrecision`), which optimizer the run uses (the
memory model counts its state) and how gradients are compressed. It carries the cluster's
definition, not a path, so it can be moved to the cluster it is for. It is written as
``{"_type": "qsync_lab.Plan", "_version": 2, "_data": {...}}`` (torchao's config
practice), atomically, and checked on load against the model and the cluster. Every
command and function that takes a plan takes this file; version-1 files are migrated on
load (:class:`PlanMigrationWarning` says what was filled in).

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
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from qsync_lab.cluster import Cluster, cluster_from_definition, list_clusters, load_cluster
from qsync_lab.compress.spec import CompressionSettings
from qsync_lab.errors import QSyncError
from qsync_lab.io import atomic_write_text
from qsync_lab.optimizers import OPTIMIZER_STATES
from qsync_lab.policy import KindPlan, OpPrecision

if TYPE_CHECKING:
    from qsync_lab.graph import OpGraph

__all__ = ["PLAN_TYPE", "SCHEMA_VERSION", "Plan", "PlanMigrationWarning", "RankPlan"]

PLAN_TYPE = "qsync_lab.Plan"
SCHEMA_VERSION = 2
_DATA_KEYS = ("model", "cluster", "ranks", "precisions", "optimizer", "compression",
              "strategy")
_V1_OPTIMIZER = "sgd_momentum"  # what a version-1 run trained with by default


class PlanMigrationWarning(UserWarning):
    """A version-1 plan was read; the warning says what its version-2 form filled in."""


@dataclass(frozen=True)
class RankPlan:
    """What one rank runs: its device kind and batch size."""

    rank: int
    device: str
    batch_size: int


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

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATES:
            raise QSyncError(f"unknown optimizer {self.optimizer!r}; choose one of: "
                             f"{', '.join(OPTIMIZER_STATES)}")
        CompressionSettings.parse(_thawed(self.compression))  # checked: one-line errors

    @classmethod
    def build(cls, graph: "OpGraph", cluster: Cluster, precisions: Mapping[str, KindPlan], *,
              strategy: str = "", optimizer: str = "sgd_momentum",
              compression: "CompressionSettings | str | Mapping | None" = None,
              model_name: str = "",
              model_kwargs: Mapping[str, Any] | None = None) -> "Plan":
        """A plan for ``graph`` on ``cluster`` (its batch sizes), checked against both.

        ``precisions`` may name device kinds by any catalog alias and give each op a
        precision name, an :class:`~qsync_lab.policy.OpPrecision` or its mapping; every
        cluster kind gets an entry (empty: all fp32). ``compression``: a spec for every
        parameter (``"global_qsgd:8"``) or a mapping pattern -> spec
        (:class:`~qsync_lab.compress.CompressionSettings`). ``model_name``/``model_kwargs``
        name the zoo model so that ``qsync-lab run`` can build it.
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
            model_kwargs=_frozen_data(model_kwargs or {}))
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
        }}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, document: Any, *, origin: str = "plan") -> "Plan":
        """Rebuild a plan from :meth:`to_dict`'s output, or migrate a version-1 document.

        Raises:
            QSyncError: not a plan, a newer schema, or a malformed field, in one line.
        """
        if not isinstance(document, dict) or document.get("_type") != PLAN_TYPE:
            found = document.get("_type") if isinstance(document, dict) else type(document)
            raise QSyncError(f"{origin} is not a qsync_lab plan (_type {found!r}, expected "
                             f"{PLAN_TYPE!r}); write it with `qsync-lab plan` or Plan.save")
        version = document.get("_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise QSyncError(f"{origin} has an invalid _version {version!r}; expected an integer "
                             ">= 1")
        if version > SCHEMA_VERSION:
            raise QSyncError(f"{origin} has plan schema version {version}, newer than this "
                             f"qsync_lab's ({SCHEMA_VERSION}); upgrade qsync_lab")
        data = document.get("_data")
        if not isinstance(data, dict):
            raise QSyncError(f"{origin} lacks its _data table; write it with Plan.save")
        if version == 1:
            data = _migrated_v1(data, origin)
        missing = [k for k in _DATA_KEYS if k not in data]
        if missing:
            raise QSyncError(f"{origin} lacks _data.{missing[0]}; write it with Plan.save")
        try:
            model, cluster = data["model"], data["cluster"]
            plan = cls(
                model_fingerprint=str(model["fingerprint"]),
                cluster_definition=_frozen_data(cluster["definition"]),
                ranks=tuple(RankPlan(_integer(r["rank"]), str(r["device"]),
                                     _integer(r["batch_size"])) for r in data["ranks"]),
                precisions=_frozen({str(kind): {str(fqn): OpPrecision.parse(cfg)
                                                for fqn, cfg in ops.items()}
                                    for kind, ops in data["precisions"].items()}),
                optimizer=str(data["optimizer"]),
                compression=_frozen_data(
                    CompressionSettings.parse(data["compression"] or None).to_dict()),
                strategy=str(data["strategy"]), model_name=str(model.get("name", "")),
                model_kwargs=_frozen_data(dict(model.get("kwargs", {}))))
        except QSyncError as err:
            raise QSyncError(f"{origin}: {err}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise QSyncError(f"{origin} is malformed ({type(err).__name__}: {err}); write it "
                             "with Plan.save") from None
        expected = cluster.get("sha256")
        if expected is not None and expected != plan.cluster.fingerprint():
            raise QSyncError(f"{origin}: its cluster definition does not match its sha256 "
                             "(the file was edited or damaged); re-plan")
        return plan

    def save(self, path: "str | os.PathLike[str]") -> None:
        """Write the plan as JSON, atomically."""
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: "str | os.PathLike[str]", *, graph: "OpGraph | None" = None,
             cluster: Cluster | None = None) -> "Plan":
        """Read a plan and check it against its cluster (or ``cluster``) and ``graph``.

        Raises:
            QSyncError: unreadable or malformed file, or see :meth:`validate`.
        """
        try:
            document = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise QSyncError(f"cannot read plan {path}: {first}") from None
        plan = cls.from_dict(document, origin=f"plan {path}")
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


def _migrated_v1(data: dict, origin: str) -> dict:
    """A version-1 ``_data`` in version-2 form (the cluster read from its file or by name)."""
    try:
        cluster = data["cluster"]
        source, name = Path(str(cluster["source"])), str(cluster["name"])
        if source.is_file():
            definition = load_cluster(source).definition
        elif name in list_clusters():
            definition = load_cluster(name).definition
        else:
            raise QSyncError(f"{origin} is a version-1 plan whose cluster file {source} is gone "
                             f"and {name!r} is not a shipped cluster; re-plan")
        model = data.get("model", {"name": "", "kwargs": {}})
        migrated = {
            "model": {**model, "fingerprint": data["model_fingerprint"]},
            "cluster": {"name": name, "definition": definition},
            "ranks": data["ranks"],
            "precisions": data["precisions"],
            "optimizer": _V1_OPTIMIZER,
            "compression": data["gradient_compression"],
            "strategy": data["strategy"],
        }
    except KeyError as err:
        raise QSyncError(f"{origin} lacks _data.{err.args[0]}; write it with Plan.save") from None
    warnings.warn(f"{origin} is a version-1 plan: read as version 2 with the cluster of "
                  f"{cluster['source']}, default backward precisions and optimizer "
                  f"{_V1_OPTIMIZER!r}; save it again to keep the version-2 form",
                  PlanMigrationWarning, stacklevel=4)
    return migrated


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


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
