"""Version-1 plan documents read in version-2 form.

A version-1 plan named its cluster by file (``source``) and name rather than carrying its
definition, had no optimizer (runs trained with ``sgd_momentum``) and called its
compression ``gradient_compression``. :func:`migrated_v1` fills those in and says so with a
:class:`PlanMigrationWarning`; saving the plan again writes the version-2 form.

Example::

    >>> import warnings
    >>> from qsync_lab.tomlfile import TomlTable
    >>> v1 = {"model_fingerprint": "abc", "strategy": "qsync",
    ...       "cluster": {"name": "local-hybrid", "source": "/gone/local-hybrid.toml"},
    ...       "ranks": [], "precisions": {}, "gradient_compression": {}}
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     data = migrated_v1(TomlTable(v1, "old.json", "_data"))
    >>> data["cluster"]["definition"]["name"], data["optimizer"], caught[0].category.__name__
    ('local-hybrid', 'sgd_momentum', 'PlanMigrationWarning')
"""

import warnings
from pathlib import Path

from qsync_lab.cluster import list_clusters, load_cluster
from qsync_lab.errors import QSyncError
from qsync_lab.plan.fields import is_any
from qsync_lab.tomlfile import TomlTable, show

__all__ = ["PlanMigrationWarning", "migrated_v1"]

_V1_DATA_KEYS = ("model_fingerprint", "cluster", "ranks", "precisions", "gradient_compression",
                 "strategy", "model")
_V1_OPTIMIZER = "sgd_momentum"  # what a version-1 run trained with by default


class PlanMigrationWarning(UserWarning):
    """A version-1 plan was read; the warning says what its version-2 form filled in."""


def migrated_v1(data: TomlTable) -> dict:
    """A version-1 ``_data`` in version-2 form (the cluster read from its file or by name)."""
    data.check_keys(_V1_DATA_KEYS)
    cluster = data.table("cluster")
    cluster.check_keys(("name", "source"))
    name, source = cluster.string("name"), cluster.string("source")
    model = data.table("model", {"name": "", "kwargs": {}})
    migrated = {
        "model": {**model.data, "fingerprint": data.value("model_fingerprint", "text", is_any)},
        "cluster": {"name": name, "definition": _v1_cluster_definition(cluster, name, source)},
        "ranks": data.value("ranks", "a list of ranks", is_any),
        "precisions": data.value("precisions", "a table of device kinds", is_any),
        "optimizer": _V1_OPTIMIZER,
        "compression": data.value("gradient_compression", "a table", is_any),
        "strategy": data.value("strategy", "text", is_any),
    }
    warnings.warn(f"{data.file} is a version-1 plan: read as version 2 with the cluster of "
                  f"{source}, default backward precisions and optimizer {_V1_OPTIMIZER!r}; "
                  "save it again to keep the version-2 form", PlanMigrationWarning,
                  stacklevel=5)  # the caller of Plan.load
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
