"""Access to the files shipped in ``qsync_lab.data`` (device catalog, clusters, profiles).

Example::

    >>> from qsync_lab.resources import data_file
    >>> data_file("devices.toml").name
    'devices.toml'
"""

from importlib.resources import files
from importlib.resources.abc import Traversable


def data_file(*parts: str) -> Traversable:
    """Return the shipped data file ``qsync_lab/data/<parts...>`` (may not exist)."""
    node = files("qsync_lab.data")
    for part in parts:
        node = node / part
    return node
