"""DDP gradient buckets, computed the way ``torch.nn.parallel.DistributedDataParallel``
builds them, so the simulator can replay DDP's communication.

What DDP does (checked against torch's own buckets in ``tests/test_buckets.py``):

* Iteration 0 puts every parameter into one bucket (torch ≥ 2.10 disables initial
  bucketing unless ``find_unused_parameters=True``, which buckets parameters in
  ``model.parameters()`` order, last bucket reduced first).
* From iteration 1 on, DDP rebuilds the buckets in the order gradients became ready in
  iteration 0 (roughly reverse forward order). With the default cap (25 MiB) the first
  of those buckets is capped at 1 MiB so communication starts early; an explicit
  ``bucket_cap_mb`` uses that one limit throughout.
* A bucket closes as soon as its size reaches the current limit; tensors of different
  dtypes never share a bucket.

Example::

    >>> bucket_assignment([400, 400, 400, 100], [1000])
    [[0, 1, 2], [3]]
"""

import sys

import pandas as pd

from qsync_lab.errors import QSyncError

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25.0
FIRST_BUCKET_BYTES = 1 * MIB


def bucket_assignment(sizes_bytes: list[int], limits_bytes: list[int],
                      keys: list[object] | None = None) -> list[list[int]]:
    """Group tensors (given in order) into buckets as DDP's reducer does.

    Args:
        sizes_bytes: size of each tensor in bytes, in the order DDP sees them.
        limits_bytes: successive bucket size limits; the last one repeats.
        keys: a grouping key per tensor (DDP uses dtype and device); tensors with
            different keys never share a bucket.

    Returns:
        Lists of tensor indices, one per bucket, full buckets in closing order followed by
        the partly filled ones in order of their first tensor.
    """
    if not limits_bytes or any(limit <= 0 for limit in limits_bytes):
        raise QSyncError(f"bucket size limits must be positive, got {limits_bytes}")
    keys = keys if keys is not None else [None] * len(sizes_bytes)
    open_buckets: dict[object, list[int]] = {}
    filled: dict[object, int] = {}
    limit_index: dict[object, int] = {}
    result: list[list[int]] = []
    for i, (size, key) in enumerate(zip(sizes_bytes, keys)):
        bucket = open_buckets.setdefault(key, [])
        bucket.append(i)
        filled[key] = filled.get(key, 0) + size
        level = limit_index.get(key, 0)
        if filled[key] >= limits_bytes[level]:
            result.append(bucket)
            open_buckets[key], filled[key] = [], 0
            limit_index[key] = min(level + 1, len(limits_bytes) - 1)
    leftovers = [b for b in open_buckets.values() if b]
    return result + sorted(leftovers, key=min)


def ddp_buckets(graph, *, bucket_cap_mb: float | None = None, iteration: str = "steady",
                find_unused_parameters: bool = False) -> pd.DataFrame:
    """The gradient buckets DDP builds for the model behind ``graph``.

    Args:
        graph: an :class:`~qsync_lab.graph.OpGraph`.
        bucket_cap_mb: DDP's ``bucket_cap_mb`` (None = DDP's default, 25 MiB with a
            1 MiB first bucket after the rebuild).
        iteration: ``"steady"`` (the rebuilt buckets DDP uses from iteration 1 on; the
            gradient-ready order is estimated as reverse forward order of each parameter's
            first use) or ``"first"`` (iteration 0's buckets).
        find_unused_parameters: DDP's flag of that name (changes iteration 0 only).

    Returns:
        DataFrame with one row per parameter that requires grad, in bucket order:
        ``bucket, param, bytes, dtype``; bucket 0 is reduced first.

    Example::

        >>> import torch, torch.nn as nn
        >>> from qsync_lab.graph import trace_graph
        >>> g = trace_graph(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), torch.randn(1, 4))
        >>> ddp_buckets(g)["param"].tolist()
        ['1.bias', '1.weight', '0.bias', '0.weight']
    """
    if iteration not in ("steady", "first"):
        raise QSyncError(f"iteration must be 'steady' or 'first', got {iteration!r}")
    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise QSyncError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    params = graph.params[graph.params["requires_grad"]]
    cap = int((bucket_cap_mb or DEFAULT_BUCKET_CAP_MB) * MIB)
    first_cap = FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    if iteration == "first":
        ordered = list(params.index)
        limits = [first_cap, cap] if find_unused_parameters else [sys.maxsize]
    else:
        ordered = _gradient_ready_order(graph, params)
        limits = [first_cap, cap]
    size_of, dtype_of = params["bytes"].to_dict(), params["dtype"].to_dict()
    sizes = [int(size_of[p]) for p in ordered]
    dtypes = [dtype_of[p] for p in ordered]
    buckets = bucket_assignment(sizes, limits, dtypes)
    if iteration == "first":
        buckets = buckets[::-1]  # DDP hands the reducer its first buckets reversed
    rows = [{"bucket": b, "param": ordered[i], "bytes": sizes[i], "dtype": dtypes[i]}
            for b, members in enumerate(buckets) for i in members]
    return pd.DataFrame(rows, columns=["bucket", "param", "bytes", "dtype"])


def _gradient_ready_order(graph, params: pd.DataFrame) -> list[str]:
    """Parameters in the order their gradients become ready in backward.

    Backward runs ops in reverse forward order; a parameter is ready once the earliest op
    that reads it has run backward. Within one op, autograd releases gradients in
    registration order (conv, norm: weight then bias), except for linear layers, whose
    weight gradient passes through an extra transpose node, so the bias comes first
    (measured against DDP's rebuilt buckets). Unused parameters come last.
    """
    position = {name: i for i, name in enumerate(graph.ops.index)}
    registration = {name: i for i, name in enumerate(params.index)}
    kind = graph.ops["kind"].to_dict()
    first_op = params["first_op"].to_dict()

    def key(param: str) -> tuple[int, int, int]:
        op = first_op[param]
        if op is None or pd.isna(op):
            return (1, 0, registration[param])
        within = -registration[param] if kind[op] == "linear" else registration[param]
        return (0, -position[op], within)

    return sorted(params.index, key=key)
