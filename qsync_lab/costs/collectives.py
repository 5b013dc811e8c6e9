"""Collective costs over a ring of links: the α–β models of :mod:`qsync_lab.costs.comm`
over the catalog's links, or over the measured fits of those links where a profile has
them (``link_fits``, :func:`qsync_lab.costs.read_link_fits`); every cost's source names
the slowest link, and its fit when it was measured.

Example::

    >>> from qsync_lab.costs.comm import ring_allreduce_us
    >>> from qsync_lab.devices import LinkSpec, load_catalog
    >>> link = load_catalog().link("eth_100g")
    >>> ring_cost(ring_allreduce_us, 100e6, 2, [link], {})   # 100 MB at 12.5 GB/s + 2 x 20 us
    Cost(us=8040.0, source='alpha-beta:eth_100g')
    >>> fits = {"eth_100g": LinkSpec("eth_100g", 5e9, 50e-6, "fit:profile:a.csv")}
    >>> ring_cost(ring_allreduce_us, 100e6, 2, [link], fits)   # 100 MB at 5 GB/s + 2 x 50 us
    Cost(us=20100.0, source='alpha-beta:eth_100g (fit:profile:a.csv)')
"""

from collections.abc import Callable, Mapping, Sequence

from qsync_lab.costs.comm import broadcast_us, slowest_link
from qsync_lab.costs.cost import Cost
from qsync_lab.devices import LinkSpec

__all__ = ["BROADCAST_SUFFIX", "broadcast_cost", "ring_cost"]

#: suffix of a link's measured DDP buffer broadcast in ``link_fits``
BROADCAST_SUFFIX = "-ddp-broadcast"


def ring_cost(collective: Callable[[float, int, Sequence[LinkSpec]], float], nbytes: float,
              ranks: int, links: Sequence[LinkSpec], link_fits: Mapping[str, LinkSpec]) -> Cost:
    """``collective`` (:func:`~qsync_lab.costs.comm.ring_allreduce_us`,
    :func:`~qsync_lab.costs.comm.ring_allgather_us`) of ``nbytes`` over ``ranks`` ranks,
    limited by the slowest of ``links``; nothing to do on a single rank."""
    if ranks == 1:
        return Cost(0.0, "single rank")
    links, source = _fitted(links, link_fits)
    return Cost(collective(nbytes, ranks, links), source)


def broadcast_cost(nbytes: float, ranks: int, links: Sequence[LinkSpec],
                   link_fits: Mapping[str, LinkSpec]) -> Cost:
    """DDP's buffer broadcast of ``nbytes`` from one rank to the others over the slowest of
    ``links``: the measured broadcast where ``link_fits`` has one for each link
    (``<link>-ddp-broadcast``, :func:`qsync_lab.profile.fit_buffer_broadcast`), else the
    links' fits in place of catalog links, as for :func:`ring_cost`."""
    fitted = [link_fits.get(f"{link.name}{BROADCAST_SUFFIX}") for link in links]
    if links and all(fitted):  # DDP's buffer broadcast measured on these links
        slowest = slowest_link(fitted)
        return Cost(broadcast_us(nbytes, ranks, fitted),
                    f"alpha-beta:{slowest.name} ({slowest.source})")
    links, source = _fitted(links, link_fits)
    return Cost(broadcast_us(nbytes, ranks, links), source)


def _fitted(links: Sequence[LinkSpec], link_fits: Mapping[str, LinkSpec]
            ) -> tuple[list[LinkSpec], str]:
    """``links`` with measured fits in place of catalog links, and the source label of
    a collective over them (the slowest link, and its fit when it was measured)."""
    links = [link_fits.get(link.name, link) for link in links]
    slowest = slowest_link(links)
    fitted = slowest.name in link_fits
    return links, f"alpha-beta:{slowest.name}" + (f" ({slowest.source})" if fitted else "")
