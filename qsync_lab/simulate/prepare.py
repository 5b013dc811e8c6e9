"""What the simulator derives from a graph once, whatever the plan and the cluster.

Simulating many plans of one model (the allocator's loop, a widget's slider) should not
re-derive the per-op arrays and DDP's buckets each time: :func:`prepare_graph` does it
once and :func:`~qsync_lab.simulate.simulate` accepts its result in place of the graph.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.graph import trace_graph
    >>> graph = trace_graph(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), torch.randn(2, 4))
    >>> prepared = prepare_graph(graph)
    >>> prepared.bucket_bytes.tolist(), prepared.bucket_ops
    ([120.0], ((1, 1, 0, 0),))
"""

from dataclasses import dataclass

import numpy as np
import pandas as pd

from qsync_lab.costs import OpWork, op_work
from qsync_lab.graph import OpGraph, ddp_buckets

__all__ = ["PreparedGraph", "prepare_graph"]


@dataclass(frozen=True, eq=False)
class PreparedGraph:
    """A graph with its per-op work and DDP buckets.

    Attributes:
        graph: the :class:`~qsync_lab.graph.OpGraph`.
        work: its :class:`~qsync_lab.costs.OpWork`.
        buckets: :func:`~qsync_lab.graph.ddp_buckets` (steady state).
        bucket_cap_mb: the cap the buckets were built with (None: DDP's default).
        bucket_bytes: bytes per bucket, in reduction order.
        bucket_ops: per bucket, the op index whose backward makes each of its gradients
            final (the first op reading the parameter; None for unused parameters).
        grad_param_bytes: bytes of the parameters that require gradients.
    """

    graph: OpGraph
    work: OpWork
    buckets: pd.DataFrame
    bucket_cap_mb: float | None
    bucket_bytes: np.ndarray
    bucket_ops: tuple[tuple[int | None, ...], ...]
    grad_param_bytes: float


def prepare_graph(graph: OpGraph, *, bucket_cap_mb: float | None = None,
                  traced_batch_size: int | None = None) -> PreparedGraph:
    """Derive the simulator's per-graph inputs once.

    Args:
        graph: the model's :class:`~qsync_lab.graph.OpGraph`.
        bucket_cap_mb: DDP's ``bucket_cap_mb`` (None: DDP's default).
        traced_batch_size: the batch size of the trace (default inferred, see
            :mod:`qsync_lab.costs.work`).
    """
    work = op_work(graph, traced_batch_size=traced_batch_size)
    buckets = ddp_buckets(graph, bucket_cap_mb=bucket_cap_mb)
    position = {name: i for i, name in enumerate(work.names)}
    first_op = {p: op for p, op in zip(graph.params.index, graph.params["first_op"])}
    bucket_bytes, bucket_ops = [], []
    for _, members in buckets.groupby("bucket", sort=True):
        bucket_bytes.append(float(members["bytes"].sum()))
        bucket_ops.append(tuple(position.get(first_op[p]) if isinstance(first_op[p], str)
                                else None for p in members["param"]))
    grads = graph.params[graph.params["requires_grad"]]
    return PreparedGraph(graph, work, buckets, bucket_cap_mb, np.array(bucket_bytes, float),
                         tuple(bucket_ops), float(grads["bytes"].sum()))
