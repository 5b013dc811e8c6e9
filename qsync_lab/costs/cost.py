"""``Cost``: a duration in µs and the source it was taken from (``profile:<file>``,
``fit:<file>``, ``roofline``, ``alpha-beta:<link>``; see :mod:`qsync_lab.costs.model`).

Example::

    >>> Cost(12.5, "roofline")
    Cost(us=12.5, source='roofline')
"""

from dataclasses import dataclass

__all__ = ["Cost"]


@dataclass(frozen=True)
class Cost:
    """A duration and where it came from."""

    us: float
    source: str
