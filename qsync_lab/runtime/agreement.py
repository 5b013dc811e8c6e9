"""Ranks agree or nobody trains: every rank compares what defines its run with the others'.

Before the first step each rank passes :func:`check_ranks_agree` a fingerprint per field
(plan, model, cluster, data, settings); the fingerprints are all-gathered and, if any field
differs between ranks, every rank raises the same one-line error naming the field and the
ranks (:func:`disagreement`), so none of them trains.

Example::

    >>> disagreement([{"plan": "a1", "data": "d"}, {"plan": "b2", "data": "d"}])
    'ranks disagree before the first step: plan differs (ranks 0 vs 1); start every rank with the same plan and options'
    >>> disagreement([{"plan": "a1"}, {"plan": "a1"}]) is None
    True
"""

from collections.abc import Mapping, Sequence

from qsync_lab.errors import QSyncError

__all__ = ["check_ranks_agree", "disagreement"]

_MISSING = "<missing>"


def check_ranks_agree(fields: Mapping[str, str]) -> None:
    """All-gather ``fields`` (name -> fingerprint) over the default process group and raise
    on every rank if any field differs between ranks (a no-op without a process group).

    Raises:
        QSyncError: :func:`disagreement`'s message, the same on every rank.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    gathered: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {str(k): str(v) for k, v in fields.items()})
    message = disagreement(gathered)
    if message is not None:
        raise QSyncError(message)


def disagreement(gathered: Sequence[Mapping[str, str]]) -> str | None:
    """The one-line message for fingerprints that differ between ranks (``gathered[r]``:
    rank ``r``'s fields), or None when every rank has the same.

    Example::

        >>> disagreement([{"plan": "a"}, {"plan": "a"}, {"plan": "b"}, {}])
        'ranks disagree before the first step: plan differs (ranks 0-1 vs 2 vs 3); start every rank with the same plan and options'
    """
    names = list(dict.fromkeys(name for fields in gathered for name in fields))
    differing = []
    for name in names:
        groups: dict[str, list[int]] = {}
        for rank, fields in enumerate(gathered):
            groups.setdefault(fields.get(name, _MISSING), []).append(rank)
        if len(groups) > 1:
            sides = " vs ".join(_ranges(ranks) for ranks in groups.values())
            differing.append(f"{name} differs (ranks {sides})")
    if not differing:
        return None
    return (f"ranks disagree before the first step: {', '.join(differing)}; start every rank "
            "with the same plan and options")


def _ranges(ranks: list[int]) -> str:
    """Sorted rank ids as ranges: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts: list[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ",".join(parts)
