"""``Plan``: the frozen, versioned result of an allocation.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.cluster import load_cluster
    >>> from qsync_lab.graph import trace_graph
    >>> graph = trace_graph(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(2, 8))
    >>> plan = Plan.build(graph, load_cluster("local-hybrid"), {"T4": {"0": "fp16"}})
    >>> Plan.from_dict(plan.to_dict()) == plan, plan.low_precision_ops()
    (True, {'V100-SXM2-32GB': 0, 'T4': 1})
"""

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qsync_lab.cluster import Cluster, cluster_from_definition
from qsync_lab.compress.spec import CompressionSettings
from qsync_lab.constraints import Constraints
from qsync_lab.errors import QSyncError
from qsync_lab.io import atomic_write_text
from qsync_lab.limits import MAX_RANKS
from qsync_lab.optimizers import OPTIMIZER_STATES
from qsync_lab.plan.document import load_document, plan_document, read_document
from qsync_lab.plan.fields import (MAX_TEXT_CHARS, RankPlan, check_model, check_text, frozen,
                                   frozen_data, thawed)
from qsync_lab.policy import KindPlan, OpPrecision, validate_plan
from qsync_lab.tomlfile import show

if TYPE_CHECKING:
    from qsync_lab.graph import OpGraph

__all__ = ["Plan"]


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
        check_text("model fingerprint", self.model_fingerprint)
        if not 1 <= len(self.ranks) <= MAX_RANKS:
            raise QSyncError(f"the plan has {len(self.ranks)} ranks; a plan has 1..{MAX_RANKS}")
        for index, rank in enumerate(self.ranks):
            if rank.rank != index:
                raise QSyncError(f"ranks[{index}] has rank id {rank.rank}; rank ids run "
                                 f"0..{len(self.ranks) - 1} in order, each once")
        if not isinstance(self.optimizer, str) or self.optimizer not in OPTIMIZER_STATES:
            raise QSyncError(f"unknown optimizer {show(self.optimizer)}; choose one of: "
                             f"{', '.join(OPTIMIZER_STATES)}")
        CompressionSettings.parse(thawed(self.compression))  # checked: one-line errors
        if not isinstance(self.strategy, str) or len(self.strategy) > MAX_TEXT_CHARS:
            raise QSyncError(f"strategy must be text of at most {MAX_TEXT_CHARS} characters, "
                             f"got {show(self.strategy)}")
        check_model(self.model_name, self.model_kwargs)
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
        names = _by_catalog_name(precisions, cluster)
        plan = cls(
            model_fingerprint=graph.fingerprint(),
            cluster_definition=frozen_data(cluster.definition),
            ranks=tuple(RankPlan(r.rank, r.device, r.batch_size) for r in cluster.ranks),
            precisions=frozen({kind: {fqn: OpPrecision.parse(p) for fqn, p in
                                       names.get(kind, {}).items()}
                                for kind in cluster.device_kinds}),
            optimizer=optimizer,
            compression=_compression_data(compression),
            strategy=strategy, model_name=model_name,
            model_kwargs=frozen_data(model_kwargs or {}),
            constraints=None if constraints is None else constraints.for_cluster(cluster))
        plan.validate(graph, cluster)
        return plan

    def for_model(self, name: str, kwargs: Mapping[str, Any] | None = None) -> "Plan":
        """This plan, recording that it is for the zoo model ``name(**kwargs)``."""
        return dataclasses.replace(self, model_name=name, model_kwargs=frozen_data(kwargs or {}))

    @functools.cached_property
    def cluster(self) -> Cluster:
        """The cluster the plan is for, with the plan's per-rank batch sizes."""
        return self.apply_to(cluster_from_definition(thawed(self.cluster_definition),
                                                     origin="the plan's cluster"))

    @property
    def compression_settings(self) -> CompressionSettings:
        """The compression section as settings (empty: none)."""
        return CompressionSettings.parse(thawed(self.compression))

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
        _check_cluster(self, cluster)
        ranks = tuple(dataclasses.replace(r, batch_size=p.batch_size)
                      for r, p in zip(cluster.ranks, self.ranks))
        return dataclasses.replace(cluster, ranks=ranks)

    def validate(self, graph: "OpGraph | None" = None, cluster: Cluster | None = None) -> None:
        """Check the plan against a model and a cluster (default: its own).

        Raises:
            QSyncError: another model, a world size or device list that does not match,
                an unknown op FQN or a precision an op or device cannot run (the policy's
                :func:`~qsync_lab.policy.validate_plan`; without a graph, only the
                devices), in one line.

        Example::

            >>> from qsync_lab.cluster import load_cluster
            >>> cluster = load_cluster("local-hybrid")
            >>> plan = Plan("abc", cluster.definition, (RankPlan(0, "V100-SXM2-32GB", 16),
            ...             RankPlan(1, "T4", 16)), {"T4": {"0": OpPrecision.parse("bf16")}})
            >>> try:
            ...     plan.validate()  # no graph: only the devices are checked
            ... except QSyncError as err:
            ...     print(str(err).split(";")[0])
            plan for T4: op '0': T4 does not support bf16
        """
        cluster = cluster if cluster is not None else self.cluster
        _check_cluster(self, cluster)
        if self.constraints is not None:
            self.constraints.for_cluster(cluster)  # its budgets are for this cluster's kinds
        work = None  # without a graph, the policy checks only the devices
        if graph is not None:
            fingerprint = graph.fingerprint()
            if fingerprint != self.model_fingerprint:
                raise QSyncError(f"the plan was made for another model (fingerprint "
                                 f"{self.model_fingerprint}, this model's is {fingerprint}); "
                                 "re-plan for this model with `qsync-lab plan`")
            from qsync_lab.costs import op_work

            work = op_work(graph)
        validate_plan(self.precisions, work, cluster.device_kinds, cluster.catalog)
        if graph is None:
            return
        unknown = [pattern for pattern, _ in self.compression_settings.rules
                   if pattern != "_default" and not pattern.startswith("re:")
                   and pattern not in graph.params.index]
        if unknown:
            raise QSyncError(f"the plan compresses parameter {unknown[0]!r}, which the model "
                             "does not have; name parameters as model.named_parameters() does")

    def to_dict(self) -> dict[str, Any]:
        """The versioned JSON document as plain Python objects
        (:func:`~qsync_lab.plan.document.plan_document`)."""
        return plan_document(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, document: Any, *, origin: str = "plan") -> "Plan":
        """Rebuild a plan from :meth:`to_dict`'s output, or migrate a version-1 document,
        checked in full: each field (:func:`~qsync_lab.plan.document.read_document`), then
        the cluster against its recorded sha256 and the plan against the cluster.

        Raises:
            QSyncError: not a plan, a newer schema, or a malformed field, in one line.
        """
        fields, sha256 = read_document(document, origin)
        try:
            plan = cls(**{**fields, "compression": _compression_data(fields["compression"])})
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
        plan = cls.from_dict(load_document(path, origin), origin=origin)
        if graph is not None or cluster is not None:
            plan.validate(graph, cluster)
        return plan


def _check_cluster(plan: Plan, cluster: Cluster) -> None:
    """``cluster`` fits ``plan``: its world size, each rank's device kind, and every device
    kind the plan names."""
    if cluster.world_size != plan.world_size:
        raise QSyncError(f"the plan is for {plan.world_size} ranks, cluster "
                         f"{cluster.name!r} has {cluster.world_size}; re-plan for this "
                         "cluster")
    for rank, planned in zip(cluster.ranks, plan.ranks):
        if cluster.catalog.device(rank.device).name != planned.device:
            raise QSyncError(f"the plan runs rank {planned.rank} as {planned.device}, "
                             f"cluster {cluster.name!r} has a {rank.device} there; "
                             "re-plan for this cluster")
    unknown = set(plan.precisions) - set(cluster.device_kinds)
    if unknown:
        raise QSyncError(f"the plan has device kind {sorted(unknown)[0]!r}, which cluster "
                         f"{cluster.name!r} does not have; re-plan for this cluster")


def _compression_data(spec: "CompressionSettings | str | Mapping | None") -> Mapping[str, Any]:
    """``spec`` parsed and written back as read-only data (one form for every spelling)."""
    return frozen_data(CompressionSettings.parse(spec).to_dict())


def _by_catalog_name(precisions: Mapping, cluster: Cluster) -> dict:
    """``precisions`` keyed by the catalog names of the cluster's device kinds."""
    names = {cluster.catalog.device(kind).name: ops for kind, ops in precisions.items()}
    unknown = sorted(set(names) - set(cluster.device_kinds))
    if unknown:
        raise QSyncError(f"the plan has device kind {unknown[0]!r}, which cluster "
                         f"{cluster.name!r} does not have ({', '.join(cluster.device_kinds)})"
                         "; remove it or fix the name")
    return names
