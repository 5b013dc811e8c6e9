"""A plan's JSON document, ``{"_type": "qsync_lab.Plan", "_version": 2, "_data": {...}}``
(torchao's config practice): written, read and checked in full before a plan is made of it.

Reading checks every field's type and bounds (batch sizes in 1..2**20, rank ids
0..world-1 in order, precisions from the policy, a model name that is never a path) and
the file's size, depth and numbers (:mod:`qsync_lab.limits`); version-1 documents are
migrated (:mod:`qsync_lab.plan.migrate`). The checks are hand-written, not a pydantic or
msgspec schema: neither is a dependency or installed (pydantic would also slow every
command's start), and most checks look names up in the catalog, policy, registry and zoo,
which a schema leaves to custom validators anyway. The plan then checks itself against its
cluster (:meth:`Plan.validate <qsync_lab.plan.Plan.validate>`).

Example::

    >>> read_document({"_type": PLAN_TYPE, "_version": 3, "_data": {}}, "plan.json")
    Traceback (most recent call last):
    qsync_lab.errors.QSyncError: plan.json has plan schema version 3, newer than this qsync_lab's (2); upgrade qsync_lab
"""

import os
from collections.abc import Mapping
from typing import Any

from qsync_lab.constraints import Constraints
from qsync_lab.errors import QSyncError
from qsync_lab.limits import MAX_RANKS, check_json_data, loads_json, read_bounded_bytes
from qsync_lab.plan.fields import RankPlan, frozen, frozen_data, is_any, thawed
from qsync_lab.plan.migrate import migrated_v1
from qsync_lab.policy import OpPrecision
from qsync_lab.tomlfile import TomlTable, is_text, show

__all__ = ["PLAN_TYPE", "SCHEMA_VERSION", "load_document", "plan_document", "read_document"]

PLAN_TYPE = "qsync_lab.Plan"
SCHEMA_VERSION = 2
_DOCUMENT_KEYS = ("_type", "_version", "_data")
_DATA_KEYS = ("model", "cluster", "ranks", "precisions", "optimizer", "compression",
              "strategy")
_OPTIONAL_DATA_KEYS = ("constraints",)  # absent in files written before plans recorded them
_MODEL_KEYS = ("name", "kwargs", "fingerprint")
_CLUSTER_KEYS = ("name", "sha256", "definition")
_RANK_KEYS = {"rank": "an integer", "device": "a device kind", "batch_size": "an integer"}


def plan_document(plan) -> dict[str, Any]:
    """The versioned JSON document of a :class:`~qsync_lab.plan.Plan`, as plain Python
    objects."""
    return {"_type": PLAN_TYPE, "_version": SCHEMA_VERSION, "_data": {
        "model": {"name": plan.model_name, "kwargs": thawed(plan.model_kwargs),
                  "fingerprint": plan.model_fingerprint},
        "cluster": {"name": plan.cluster_name,
                    "sha256": plan.cluster.fingerprint(),
                    "definition": thawed(plan.cluster_definition)},
        "ranks": [{"rank": r.rank, "device": r.device, "batch_size": r.batch_size}
                  for r in plan.ranks],
        "precisions": {kind: {fqn: cfg.to_dict() for fqn, cfg in ops.items()}
                       for kind, ops in plan.precisions.items()},
        "optimizer": plan.optimizer,
        "compression": thawed(plan.compression),
        "strategy": plan.strategy,
        "constraints": None if plan.constraints is None else plan.constraints.to_dict(),
    }}


def load_document(path: "str | os.PathLike[str]", origin: str) -> Any:
    """The JSON document in the file ``path`` (at most
    :data:`~qsync_lab.limits.MAX_FILE_BYTES`, strict JSON), not yet checked."""
    try:
        text = read_bounded_bytes(path, origin).decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise QSyncError(f"cannot read plan {path}: {first}") from None
    return loads_json(text, origin)


def read_document(document: Any, origin: str) -> tuple[dict[str, Any], str | None]:
    """The fields of the plan ``document`` describes, each checked on its own, and the
    sha256 it records of its cluster (None if absent); a version-1 document is migrated.

    The fields are :class:`~qsync_lab.plan.Plan`'s keyword arguments, ``compression`` as
    written (:class:`~qsync_lab.compress.CompressionSettings` parses it).

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
        data = TomlTable(migrated_v1(data), origin, "_data")
    missing = [k for k in _DATA_KEYS if k not in data.data]
    if missing:
        raise QSyncError(f"{origin} lacks _data.{missing[0]}; write it with Plan.save")
    data.check_keys(_DATA_KEYS + _OPTIONAL_DATA_KEYS)
    model, cluster = data.table("model"), data.table("cluster")
    model.check_keys(_MODEL_KEYS)
    cluster.check_keys(_CLUSTER_KEYS)
    fields = dict(
        model_fingerprint=model.string("fingerprint"),
        cluster_definition=frozen_data(cluster.table("definition").data),
        ranks=_read_ranks(data), precisions=_read_precisions(data.table("precisions")),
        optimizer=data.value("optimizer", "text", _is_str),
        strategy=data.value("strategy", "text", _is_str),
        model_name=model.value("name", "text", _is_str, ""),
        model_kwargs=frozen_data(model.table("kwargs", {}).data),
        constraints=_read_constraints(data),
        compression=data.data["compression"])
    cluster.value("name", "text", _is_str, "")  # the definition's name is the one used
    return fields, cluster.value("sha256", "a sha256 hex digest", is_text, None)


def _read_ranks(data: TomlTable) -> tuple[RankPlan, ...]:
    """``_data.ranks``: each entry's fields present and in bounds."""
    tables = data.tables("ranks")
    if len(tables) > MAX_RANKS:
        raise data.error(f"{len(tables)} entries, over the limit of {MAX_RANKS} ranks", "ranks")
    ranks = []
    for table in tables:
        table.check_keys(_RANK_KEYS)
        values = {key: table.value(key, expected, is_any) for key, expected in _RANK_KEYS.items()}
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
    return frozen(parsed)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)
