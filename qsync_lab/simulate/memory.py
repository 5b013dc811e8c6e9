"""Peak training memory of one rank, by component.

Components (bytes), all held at once at the start of backward, which makes the sum an
upper bound of what PyTorch's allocator reports as ``max_memory_allocated``:

* ``master_weights``: every parameter in its own dtype (fp32);
* ``low_precision_weights``: the per-iteration weight copy of every op whose forward
  precision is not stored in fp32 (``numel * bits / 8``);
* ``gradients``: the fp32 ``.grad`` of every parameter that requires one;
* ``ddp_buckets``: DDP's flat bucket buffers, one more copy of those gradients
  (``gradient_as_bucket_view=False``, DDP's default);
* ``optimizer_state``: 0x (plain SGD), 1x (SGD with momentum) or 2x (Adam) the
  gradients;
* ``activations``: per op, its ``saved_bytes`` at the rank's batch size and the op's
  storage precision (``bits / 32``; int8 ops save int8). Summed per op, so a tensor two
  ops save at the same precision counts twice;
* ``workspace``: the largest transient of backward: the output gradient and the input
  gradient of one op alive at once, at its backward precision.

Not modelled: the CUDA context and allocator fragmentation (outside
``max_memory_allocated``), library workspaces (cuBLAS, cuDNN), the loss and logits kept
after forward.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.costs import op_work
    >>> from qsync_lab.devices import load_catalog
    >>> from qsync_lab.graph import trace_graph
    >>> from qsync_lab.simulate.policy import resolve_precisions
    >>> graph = trace_graph(nn.Linear(10, 10), torch.randn(4, 10))
    >>> work = op_work(graph)
    >>> a = resolve_precisions(work, {}, load_catalog().device("T4"))
    >>> memory = memory_breakdown(work, graph.params, a, batch_size=4, optimizer="sgd",
    ...                           bucket_bytes=440)
    >>> memory["master_weights"], memory["gradients"], memory["activations"]
    (440.0, 440.0, 160.0)
"""

import numpy as np
import pandas as pd

from qsync_lab.costs import OpWork, batch_scales, optimizer_state_count
from qsync_lab.costs.work import bits_ratio
from qsync_lab.precision import Precision
from qsync_lab.simulate.policy import PrecisionAssignment, storage_precision

__all__ = ["MEMORY_COMPONENTS", "memory_breakdown"]

MEMORY_COMPONENTS = ("master_weights", "low_precision_weights", "gradients", "ddp_buckets",
                     "optimizer_state", "activations", "workspace")


def memory_breakdown(work: OpWork, params: pd.DataFrame, assignment: PrecisionAssignment, *,
                     batch_size: int, optimizer: str, bucket_bytes: float) -> dict[str, float]:
    """Bytes per component of :data:`MEMORY_COMPONENTS` for one rank.

    Args:
        work: the graph's :class:`~qsync_lab.costs.OpWork`.
        params: ``graph.params``.
        assignment: the rank's per-op precisions.
        batch_size: the rank's batch size.
        optimizer: ``sgd``, ``sgd_momentum``, ``adam`` or ``adamw``.
        bucket_bytes: total size of DDP's gradient buckets.
    """
    scale = batch_scales(work, batch_size)
    stored = [storage_precision(p) for p in assignment.precision]
    low = np.array([p is not Precision.FP32 for p in stored], bool)
    stored_bits = np.array([p.bits for p in stored], float)
    backward_ratio = bits_ratio([storage_precision(q) for q in assignment.backward])
    gradients = float(params.loc[params["requires_grad"], "bytes"].sum())
    transient = (work.out_bytes + work.act_read_bytes) * scale * backward_ratio
    return {
        "master_weights": float(params["bytes"].sum()),
        "low_precision_weights": float((work.weight_numel * stored_bits / 8)[low].sum()),
        "gradients": gradients,
        "ddp_buckets": float(bucket_bytes),
        "optimizer_state": optimizer_state_count(optimizer) * gradients,
        "activations": float((work.saved_bytes * scale * stored_bits / 32).sum()),
        "workspace": float(transient.max()) if len(work) else 0.0,
    }
