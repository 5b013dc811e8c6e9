"""``Plan``: the frozen, versioned result of an allocation, as one JSON file.

A plan says, for one model on one cluster, which batch size every rank runs, which
precision every planned op runs in on each device kind, and (filled by gradient
compression, issue #9) how each parameter's gradient is compressed. It is written as
``{"_type": "qsync_lab.Plan", "_version": 1, "_data": {...}}`` (torchao's config
practice), atomically, and checked on load against the model and the cluster.

Example::

    >>> import tempfile, pathlib
    >>> import torch, torch.nn as nn
    >>> from qsync_lab.cluster import load_cluster
    >>> from qsync_lab.graph import trace_graph
    >>> graph = trace_graph(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(2, 8))
    >>> cluster = load_cluster("local-hybrid")
    >>> plan = Plan.build(graph, cluster, {"T4": {"0": "fp16"}}, strategy="manual")
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "plan.json"
    >>> plan.save(path)
    >>> Plan.load(path, graph=graph, cluster=cluster) == plan
    True
    >>> plan.simulator_plan()
    {'V100-SXM2-32GB': {}, 'T4': {'0': 'fp16'}}
"""

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from qsync_lab.cluster import Cluster
from qsync_lab.errors import QSyncError
from qsync_lab.graph import OpGraph
from qsync_lab.io import atomic_write_text
from qsync_lab.precision import Precision

__all__ = ["PLAN_TYPE", "SCHEMA_VERSION", "Plan", "RankPlan"]

PLAN_TYPE = "qsync_lab.Plan"
SCHEMA_VERSION = 1
_DATA_KEYS = ("model_fingerprint", "cluster", "ranks", "precisions", "gradient_compression",
              "strategy")


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
        cluster_name: the cluster's name.
        cluster_source: the file the cluster was read from.
        ranks: per rank, its device kind and batch size (the plan may change batches).
        precisions: device kind -> {op FQN -> precision}; ops left out run as the
            simulator's policy says (fp32 for plannable kinds).
        gradient_compression: parameter FQN -> compression settings (issue #9; empty
            means plain fp32 allreduce).
        strategy: which allocator made the plan.
        model_name: the zoo model planned for, if any (the runtime builds it from this).
        model_kwargs: the zoo model's keyword arguments.
        schema_version: the JSON schema version (``_version``).
    """

    model_fingerprint: str
    cluster_name: str
    cluster_source: str
    ranks: tuple[RankPlan, ...]
    precisions: Mapping[str, Mapping[str, Precision]] = field(hash=False)
    gradient_compression: Mapping[str, Mapping[str, Any]] = field(default_factory=dict,
                                                                   hash=False)
    strategy: str = ""
    model_name: str = ""
    model_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def build(cls, graph: OpGraph, cluster: Cluster,
              precisions: Mapping[str, Mapping[str, "Precision | str"]], *,
              strategy: str = "", gradient_compression: Mapping[str, Mapping[str, Any]] = None,
              model_name: str = "", model_kwargs: Mapping[str, Any] | None = None) -> "Plan":
        """A plan for ``graph`` on ``cluster`` (its batch sizes), checked against both.

        ``precisions`` may name device kinds by any catalog alias; every cluster kind
        gets an entry (empty: all fp32). ``model_name``/``model_kwargs`` name the zoo model
        so that ``python -m qsync_lab.runtime --plan`` can build it without ``--model``.
        """
        names = {cluster.catalog.device(kind).name: ops for kind, ops in precisions.items()}
        plan = cls(
            model_fingerprint=graph.fingerprint(),
            cluster_name=cluster.name,
            cluster_source=str(cluster.source),
            ranks=tuple(RankPlan(r.rank, r.device, r.batch_size) for r in cluster.ranks),
            precisions=_frozen({kind: {fqn: Precision.parse(p) for fqn, p in
                                       names.get(kind, {}).items()}
                                for kind in cluster.device_kinds}),
            gradient_compression=_frozen(gradient_compression or {}),
            strategy=strategy, model_name=model_name,
            model_kwargs=MappingProxyType(dict(model_kwargs or {})))
        plan.validate(graph, cluster)
        return plan

    def for_model(self, name: str, kwargs: Mapping[str, Any] | None = None) -> "Plan":
        """This plan, recording that it is for the zoo model ``name(**kwargs)``."""
        return dataclasses.replace(self, model_name=name,
                                   model_kwargs=MappingProxyType(dict(kwargs or {})))

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Per-rank batch sizes, in rank order."""
        return tuple(r.batch_size for r in self.ranks)

    def simulator_plan(self) -> dict[str, dict[str, str]]:
        """The plan as :func:`~qsync_lab.simulate.simulate` and ``apply_plan_`` take it."""
        return {kind: {fqn: str(p) for fqn, p in ops.items()}
                for kind, ops in self.precisions.items()}

    def low_precision_ops(self) -> dict[str, int]:
        """Per device kind, how many ops the plan runs in a precision other than fp32."""
        return {kind: sum(p is not Precision.FP32 for p in ops.values())
                for kind, ops in self.precisions.items()}

    def apply_to(self, cluster: Cluster) -> Cluster:
        """``cluster`` with this plan's per-rank batch sizes (checked first).

        Example::

            >>> from qsync_lab.cluster import load_cluster
            >>> cluster = load_cluster("local-hybrid")
            >>> plan = Plan("abc", cluster.name, cluster.source,
            ...             (RankPlan(0, "V100-SXM2-32GB", 20), RankPlan(1, "T4", 12)), {})
            >>> [r.batch_size for r in plan.apply_to(cluster).ranks]
            [20, 12]
        """
        self._check_cluster(cluster)
        ranks = tuple(dataclasses.replace(r, batch_size=p.batch_size)
                      for r, p in zip(cluster.ranks, self.ranks))
        return dataclasses.replace(cluster, ranks=ranks)

    def validate(self, graph: OpGraph | None = None, cluster: Cluster | None = None) -> None:
        """Check the plan against a model and/or a cluster.

        Raises:
            QSyncError: another model, a world size or device list that does not match,
                an unknown op FQN or a precision a device cannot run, in one line.
        """
        if cluster is not None:
            self._check_cluster(cluster)
        if graph is not None:
            fingerprint = graph.fingerprint()
            if fingerprint != self.model_fingerprint:
                raise QSyncError(f"the plan was made for another model (fingerprint "
                                 f"{self.model_fingerprint}, this model's is {fingerprint}); "
                                 "re-plan for this model with `qsync-lab plan`")
        if graph is not None and cluster is not None:
            from qsync_lab.costs import op_work
            from qsync_lab.policy import validate_plan

            validate_plan(self.simulator_plan(), op_work(graph), cluster.device_kinds,
                          cluster.catalog)
        elif cluster is not None:
            for kind, ops in self.precisions.items():
                device = cluster.catalog.device(kind)
                for fqn, p in ops.items():
                    if not device.supports(p):
                        raise QSyncError(f"plan for {kind}: op {fqn!r}: "
                                         f"{kind} cannot run {p}; re-plan for this cluster")

    def to_dict(self) -> dict[str, Any]:
        """The versioned JSON document as plain Python objects."""
        return {"_type": PLAN_TYPE, "_version": self.schema_version, "_data": {
            "model_fingerprint": self.model_fingerprint,
            "cluster": {"name": self.cluster_name, "source": self.cluster_source},
            "ranks": [{"rank": r.rank, "device": r.device, "batch_size": r.batch_size}
                      for r in self.ranks],
            "precisions": self.simulator_plan(),
            "gradient_compression": {k: dict(v) for k, v in self.gradient_compression.items()},
            "strategy": self.strategy,
            "model": {"name": self.model_name, "kwargs": dict(self.model_kwargs)},
        }}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, document: Any, *, origin: str = "plan") -> "Plan":
        """Rebuild a plan from :meth:`to_dict`'s output (QSyncError if malformed)."""
        if not isinstance(document, dict) or document.get("_type") != PLAN_TYPE:
            found = document.get("_type") if isinstance(document, dict) else type(document)
            raise QSyncError(f"{origin} is not a qsync_lab plan (_type {found!r}, expected "
                             f"{PLAN_TYPE!r}); write it with Plan.save")
        version = document.get("_version")
        if not isinstance(version, int) or version < 1:
            raise QSyncError(f"{origin} has an invalid _version {version!r}; expected an integer "
                             f">= 1")
        if version > SCHEMA_VERSION:
            raise QSyncError(f"{origin} has plan schema version {version}, newer than this "
                             f"qsync_lab's ({SCHEMA_VERSION}); upgrade qsync_lab")
        data = document.get("_data")
        missing = [k for k in _DATA_KEYS if not isinstance(data, dict) or k not in data]
        if missing:
            raise QSyncError(f"{origin} lacks _data.{missing[0]}; write it with Plan.save")
        try:
            ranks = tuple(RankPlan(int(r["rank"]), str(r["device"]), int(r["batch_size"]))
                          for r in data["ranks"])
            precisions = {str(kind): {str(fqn): Precision.parse(p) for fqn, p in ops.items()}
                          for kind, ops in data["precisions"].items()}
            compression = {str(k): dict(v) for k, v in data["gradient_compression"].items()}
            cluster = data["cluster"]
            model = data.get("model", {"name": "", "kwargs": {}})  # optional: older plans
            return cls(str(data["model_fingerprint"]), str(cluster["name"]),
                       str(cluster["source"]), ranks, _frozen(precisions), _frozen(compression),
                       str(data["strategy"]), str(model["name"]),
                       MappingProxyType(dict(model["kwargs"])), version)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            if isinstance(err, QSyncError):
                raise QSyncError(f"{origin}: {err}") from None
            raise QSyncError(f"{origin} is malformed ({type(err).__name__}: {err}); write it "
                             "with Plan.save") from None

    def save(self, path: "str | os.PathLike[str]") -> None:
        """Write the plan as JSON, atomically."""
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: "str | os.PathLike[str]", *, graph: OpGraph | None = None,
             cluster: Cluster | None = None) -> "Plan":
        """Read a plan and check it against ``graph`` and ``cluster`` when given.

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


def _frozen(mapping: Mapping[str, Mapping]) -> Mapping[str, Mapping]:
    return MappingProxyType({k: MappingProxyType(dict(v)) for k, v in mapping.items()})
