"""Ring allreduce cost (α–β model over the slowest link of the ring).

A ring allreduce of ``S`` bytes over ``n`` ranks is a reduce-scatter plus an all-gather:
each rank sends and receives ``2(n−1)/n · S`` bytes in ``2(n−1)`` steps, and every step
waits for the slowest hop, so ``time = 2(n−1)/n · S/β + 2(n−1)·α`` with ``β`` the lowest
bandwidth and ``α`` the highest latency among the ring's links. One rank: nothing to do.

Example::

    >>> from qsync_lab.devices import LinkSpec
    >>> link = LinkSpec("eth", bandwidth_Bps=1e9, latency_s=10e-6, source="test")
    >>> ring_allreduce_us(4_000_000, 4, [link])   # 1.5 * 4 ms + 6 * 10 us
    6060.0
    >>> ring_wire_bytes(4_000_000, 4)
    6000000.0
"""

from collections.abc import Sequence

from qsync_lab.devices import US_PER_SECOND, LinkSpec
from qsync_lab.errors import QSyncError

__all__ = ["broadcast_us", "ring_allgather_us", "ring_allreduce_us", "ring_wire_bytes",
           "slowest_link"]


def ring_wire_bytes(nbytes: float, ranks: int) -> float:
    """Bytes each rank sends in a ring allreduce of ``nbytes``."""
    if ranks < 1:
        raise QSyncError(f"an allreduce needs at least one rank, got {ranks}")
    return 2 * (ranks - 1) / ranks * nbytes


def slowest_link(links: Sequence[LinkSpec]) -> LinkSpec:
    """A link with the lowest bandwidth and the highest latency of ``links``.

    Example::

        >>> from qsync_lab.devices import LinkSpec
        >>> a, b = LinkSpec("a", 10e9, 2e-6, "x"), LinkSpec("b", 1e9, 1e-6, "x")
        >>> slowest_link([a, b])
        LinkSpec(name='b', bandwidth_Bps=1000000000.0, latency_s=2e-06, source='x')
    """
    if not links:
        raise QSyncError("an allreduce over several ranks needs at least one link")
    narrowest = min(links, key=lambda link: link.bandwidth_Bps)
    latency_s = max(link.latency_s for link in links)
    return LinkSpec(narrowest.name, narrowest.bandwidth_Bps, latency_s, narrowest.source)


def broadcast_us(nbytes: float, ranks: int, links: Sequence[LinkSpec]) -> float:
    """Pipelined chain broadcast of ``nbytes`` from one rank to ``ranks - 1`` others: one
    latency per hop, the bytes once over the slowest link.

    Example::

        >>> from qsync_lab.devices import LinkSpec
        >>> broadcast_us(1e6, 2, [LinkSpec("l", 1e9, 100e-6, "x")])   # 100 us + 1 MB at 1 GB/s
        1100.0
    """
    if ranks == 1 or nbytes == 0:
        return 0.0
    link = slowest_link(links)
    return ((ranks - 1) * link.latency_s + nbytes / link.bandwidth_Bps) * US_PER_SECOND


def ring_allreduce_us(nbytes: float, ranks: int, links: Sequence[LinkSpec]) -> float:
    """Ring allreduce time of ``nbytes`` over ``ranks`` ranks joined by ``links``."""
    if ranks == 1 or nbytes == 0:
        return 0.0
    link = slowest_link(links)
    seconds = ring_wire_bytes(nbytes, ranks) / link.bandwidth_Bps + 2 * (ranks - 1) * link.latency_s
    return seconds * US_PER_SECOND


def ring_allgather_us(nbytes: float, ranks: int, links: Sequence[LinkSpec]) -> float:
    """Ring all-gather of ``nbytes`` from every rank: each rank sends and receives the
    others' ``(n-1)·S`` bytes in ``n-1`` steps.

    Example::

        >>> from qsync_lab.devices import LinkSpec
        >>> ring_allgather_us(1e6, 3, [LinkSpec("l", 1e9, 10e-6, "x")])   # 2 x (1 ms + 10 us)
        2020.0
    """
    if ranks == 1 or nbytes == 0:
        return 0.0
    link = slowest_link(links)
    return (ranks - 1) * (nbytes / link.bandwidth_Bps + link.latency_s) * US_PER_SECOND
