"""Where files live: those shipped in ``qsync_lab.data`` (device catalog, clusters,
profiles) and the cache of what this machine measured or derived once
(``$QSYNC_LAB_CACHE``, default ``~/.cache/qsync_lab``).

Example::

    >>> from qsync_lab.resources import data_file
    >>> data_file("devices.toml").name
    'devices.toml'
"""

import os
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path


def data_file(*parts: str) -> Traversable:
    """Return the shipped data file ``qsync_lab/data/<parts...>`` (may not exist)."""
    node = files("qsync_lab.data")
    for part in parts:
        node = node / part
    return node


def cache_dir() -> Path:
    """``$QSYNC_LAB_CACHE`` or ``~/.cache/qsync_lab``."""
    return Path(os.environ.get("QSYNC_LAB_CACHE") or Path.home() / ".cache" / "qsync_lab")
