"""Peak training memory of one rank, by component, at the moment of the peak.

Held for the whole step:

* ``master_weights``: every parameter in its own dtype (fp32);
* ``ddp_buckets``: DDP's flat bucket buffers, one more copy of the gradients
  (``gradient_as_bucket_view=False``, DDP's default);
* ``optimizer_state``: 0x (plain SGD), 1x (SGD with momentum) or 2x (Adam) the
  gradients.

Changing over backward, which runs the ops in reverse; while op ``i``'s backward runs:

* ``activations``: what ops ``0..i`` saved for backward (an op's saved tensors are freed
  once its backward has run): per op its ``saved_bytes`` at the rank's batch size,
  summed per op, so a tensor two ops save at the same precision counts twice. GEMM-shaped
  ops (linear, conv, matmul) save their operands encoded in their precision (``bits /
  32``; int8 saves int8); every other op saves fp32, since qsync_lab's runtime rounds the
  values of the activations between ops to an op's format, never their storage
  (:func:`saved_bits`);
* ``low_precision_weights``: the weight copies ops ``0..i`` encoded for forward and saved
  for backward: GEMM-shaped ops (linear, conv) whose precision is not stored in fp32
  (``numel * bits / 8``);
* ``gradients``: the fp32 ``.grad`` of every parameter whose first reader is op ``i`` or
  later (``optimizer.zero_grad()`` frees them every step, backward allocates them);
* ``workspace``: op ``i``'s output gradient and input gradient, alive at once, at its
  backward precision.

The peak is the largest sum over the ops' backward steps, and the components are those
of that moment: deep activation-heavy models peak early in backward (activations all
held, few gradients yet), parameter-heavy ones at its end (every gradient held).
``benchmarks/predictor_accuracy.py`` compares these peaks with measured ones on 2-rank CPU
DDP (``benchmarks/results/predictor_accuracy_cpu.txt``); bf16 peaks come out low there, as
the CPU emulation's forward also holds each operand widened to fp32 for a moment (a
forward transient not modelled).

Not modelled: the CUDA context and allocator fragmentation (outside
``max_memory_allocated``), library workspaces (cuBLAS, cuDNN), an optimizer's
temporaries during its step (foreach Adam's ``sqrt`` of the second moment), the loss and
logits kept after forward.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.costs import op_work
    >>> from qsync_lab.devices import load_catalog
    >>> from qsync_lab.graph import trace_graph
    >>> from qsync_lab.policy import resolve_precisions
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

from qsync_lab.costs import OpWork, batch_scales
from qsync_lab.costs.work import bits_ratio
from qsync_lab.optimizers import optimizer_state_count
from qsync_lab.precision import Precision
from qsync_lab.policy import PrecisionAssignment, storage_precision

__all__ = ["ENCODED_KINDS", "MEMORY_COMPONENTS", "MemoryModel", "memory_breakdown", "saved_bits"]

MEMORY_COMPONENTS = ("master_weights", "low_precision_weights", "gradients", "ddp_buckets",
                     "optimizer_state", "activations", "workspace")
#: op kinds whose runtime versions save their operands (and copy their weight) encoded
ENCODED_KINDS = frozenset({"linear", "conv1d", "conv2d", "conv3d", "matmul"})
_STORAGE = {p: storage_precision(p) for p in Precision}
_STORED_BITS = {p: storage.bits for p, storage in _STORAGE.items()}


def saved_bits(kind: str, precision: Precision) -> int:
    """Bits per element of what an op of ``kind`` computed in ``precision`` saves.

    Example::

        >>> saved_bits("linear", Precision.INT8), saved_bits("layer_norm", Precision.BF16)
        (8, 32)
    """
    return storage_precision(precision).bits if kind in ENCODED_KINDS else 32


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
    return MemoryModel(work, params, optimizer=optimizer,
                       bucket_bytes=bucket_bytes).breakdown(assignment, batch_size=batch_size)


class MemoryModel:
    """:func:`memory_breakdown` of one graph for many assignments: what no plan changes
    (the parameters, the gradients held per op, the buckets, the optimizer state) is
    derived once."""

    def __init__(self, work: OpWork, params: pd.DataFrame, *, optimizer: str,
                 bucket_bytes: float) -> None:
        self.work = work
        self._encoded = np.array([kind in ENCODED_KINDS for kind in work.kinds], bool)
        self._held_gradients = np.cumsum(_gradient_bytes_by_first_reader(work, params)[::-1])[::-1]
        gradients = float(params.loc[params["requires_grad"], "bytes"].sum())
        self._master_bytes = float(params["bytes"].sum())
        self._bucket_bytes = float(bucket_bytes)
        self._optimizer_bytes = optimizer_state_count(optimizer) * gradients
        self._batched: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def breakdown(self, assignment: PrecisionAssignment, *, batch_size: int) -> dict[str, float]:
        """Bytes per component of :data:`MEMORY_COMPONENTS` for one rank."""
        work = self.work
        saved_fp32, transient_fp32 = self._at_batch(batch_size)
        stored_bits = np.where(self._encoded, [_STORED_BITS[p] for p in assignment.precision],
                               32.0)
        backward_ratio = bits_ratio([_STORAGE[q] for q in assignment.backward])
        saved = saved_fp32 * stored_bits / 32
        copies = np.where(stored_bits < 32, work.weight_numel * stored_bits / 8, 0.0)
        transient = transient_fp32 * backward_ratio
        held_activations = np.cumsum(saved)  # while op i's backward runs: ops 0..i
        held_copies = np.cumsum(copies)
        held_gradients = self._held_gradients
        peak_at = int(np.argmax(held_activations + held_copies + held_gradients + transient))
        return {
            "master_weights": self._master_bytes,
            "low_precision_weights": float(held_copies[peak_at]),
            "gradients": float(held_gradients[peak_at]),
            "ddp_buckets": self._bucket_bytes,
            "optimizer_state": self._optimizer_bytes,
            "activations": float(held_activations[peak_at]),
            "workspace": float(transient[peak_at]),
        }

    def _at_batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Per op at ``batch_size`` in fp32: the bytes it saves, and its output gradient and
        input gradient together."""
        if batch_size not in self._batched:
            work, scale = self.work, batch_scales(self.work, batch_size)
            self._batched[batch_size] = (work.saved_bytes * scale,
                                         (work.out_bytes + work.act_read_bytes) * scale)
        return self._batched[batch_size]


def _gradient_bytes_by_first_reader(work: OpWork, params: pd.DataFrame) -> np.ndarray:
    """Per op, the fp32 gradient bytes of the parameters it is the first to read (where
    DDP's buckets place them too); a parameter no traced op reads counts at op 0."""
    position = {name: i for i, name in enumerate(work.names)}
    by_op = np.zeros(len(work))
    trainable = params[params["requires_grad"]]
    for op, nbytes in zip(trainable["first_op"], trainable["bytes"]):
        by_op[position.get(op, 0)] += nbytes
    return by_op
