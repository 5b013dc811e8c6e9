"""Peak training memory of one rank, by component, at the moment of the peak.

Held for the whole step:

* ``master_weights``: every parameter in its own dtype (fp32);
* ``ddp_buckets``: DDP's flat bucket buffers, one more copy of the gradients
  (``gradient_as_bucket_view=False``, DDP's default);
* ``optimizer_state``: 0x (plain SGD), 1x (SGD with momentum) or 2x (Adam) the
  gradients.

Changing over backward, which runs the ops in reverse; while op ``i``'s backward runs:

* ``activations``: what ops ``0..i`` saved for backward (an op's saved tensors are freed
  once its backward has run), at the rank's batch size: an op's activations grow with
  the batch when its work does (:func:`qsync_lab.costs.work.batch_sized`: a tensor's
  first dimension is the batch, or the op reads such an op's output, as a sequence
  model's loss reads ``(batch * tokens, classes)`` logits). A tensor is stored in its
  writer's output format (``assignment.output``: fp16/bf16 ops write fp16/bf16, the
  others fp32), and an op keeps what it saves in its own format (:func:`keep_format`: a
  GEMM in its precision's, int8 as int8; an activation following a 16-bit op in 16
  bits; a layer norm in fp32). Where the two agree the op keeps the tensor itself, and a
  tensor several ops keep so (a ReLU's output that the next convolution saves too, an
  attention's output that the out-projection saves as a view, a layer norm's output that
  three fp32 projections read) is held once, until the backward of the first of them in
  forward order; where they differ the op keeps its own copy (a bf16 GEMM reading an
  fp32 ReLU output, an fp32 norm reading a bf16 GEMM's). ``OpWork.saved_tensors`` (from
  :func:`qsync_lab.graph.opgraph.saved_tensors`) says which ops keep which tensors (a
  saved view keeps its producer's whole output);
* ``low_precision_weights``: the weight copies ops ``0..i`` encoded for forward and saved
  for backward: GEMM-shaped ops (linear, conv) whose precision is not stored in fp32
  (``numel * bits / 8``);
* ``gradients``: the fp32 ``.grad`` of every parameter whose first reader is op ``i`` or
  later (``optimizer.zero_grad()`` frees them every step, backward allocates them);
* ``workspace``: op ``i``'s output gradient and input gradient, alive at once, at its
  backward precision, and any gradient its backward makes inside it (cross-entropy's
  gradient of the log-probabilities, the size of the logits, before the logits' own).

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
logits kept after forward, and the 16-bit values that natively pass through the ops the
policy runs in fp32 but the runtime does not guard (an ``add``, a softmax, GELU,
``F.scaled_dot_product_attention`` after a bf16 GEMM run and save in bf16 on CUDA;
counted here in fp32, as the policy has them).

A rank that emulates its precisions (``DeviceSpec.emulated``: the CPU, or a GPU kind a
CPU plays) rounds values, not storage: there every output, every kept operand but a
GEMM's encoded ones, and the backward's gradients are fp32, and a low-precision GEMM's
backward widens its encoded input and weight back to fp32 (counted as held together; the
emulation widens one per product, and copies the output gradient it rounds). Not counted
there: the second operand of a weightless matmul (attention scores) widened likewise.

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
from qsync_lab.policy import (GEMM_KINDS, PLANNABLE_KINDS, PrecisionAssignment,
                              storage_precision)

__all__ = ["MEMORY_COMPONENTS", "MemoryModel", "keep_format", "memory_breakdown"]

MEMORY_COMPONENTS = ("master_weights", "low_precision_weights", "gradients", "ddp_buckets",
                     "optimizer_state", "activations", "workspace")
_STORAGE = {p: storage_precision(p) for p in Precision}
_STORED_BITS = {p: storage.bits for p, storage in _STORAGE.items()}
#: a storage format's code in the arrays of :class:`_SharedTensors`, and its bits by code
_FORMAT = {p: code for code, p in enumerate(Precision)}
_FORMAT_BITS = np.array([_STORED_BITS[p] for p in Precision], float)
_STORAGE_FORMAT = {p: _FORMAT[storage] for p, storage in _STORAGE.items()}


def keep_format(kind: str, precision: Precision) -> Precision:
    """The storage format an op of ``kind`` computed in ``precision`` keeps its saved
    float operands in: its precision's (tf32 as fp32), but fp32 for the norms that take
    fp32 inputs inside their 16-bit boundary (``KindRule.fp32_inside``: layer norm does,
    batch norm reads the 16-bit inputs itself).

    Example::

        >>> keep_format("activation", Precision.BF16), keep_format("layer_norm", Precision.BF16)
        (<Precision.BF16: 'bf16'>, <Precision.FP32: 'fp32'>)
    """
    rule = PLANNABLE_KINDS.get(kind)
    if rule is not None and not rule.replaces_forward and getattr(rule, "fp32_inside", True):
        return Precision.FP32
    return _STORAGE[precision]


def memory_breakdown(work: OpWork, params: pd.DataFrame, assignment: PrecisionAssignment, *,
                     batch_size: int, optimizer: str, bucket_bytes: float,
                     emulated: bool = False) -> dict[str, float]:
    """Bytes per component of :data:`MEMORY_COMPONENTS` for one rank.

    Args:
        work: the graph's :class:`~qsync_lab.costs.OpWork`.
        params: ``graph.params``.
        assignment: the rank's per-op precisions.
        batch_size: the rank's batch size.
        optimizer: ``sgd``, ``sgd_momentum``, ``adam`` or ``adamw``.
        bucket_bytes: total size of DDP's gradient buckets.
        emulated: the rank emulates its precisions (``DeviceSpec.emulated``: the CPU, or a
            kind a CPU plays): its ops write fp32-dtype values and only the GEMMs keep
            their encoded operands in the low format.
    """
    return MemoryModel(work, params, optimizer=optimizer, bucket_bytes=bucket_bytes
                       ).breakdown(assignment, batch_size=batch_size, emulated=emulated)


class MemoryModel:
    """:func:`memory_breakdown` of one graph for many assignments: what no plan changes
    (the parameters, the gradients held per op, the buckets, the optimizer state) is
    derived once. Which activations several ops keep is ``work.saved_tensors``."""

    def __init__(self, work: OpWork, params: pd.DataFrame, *, optimizer: str,
                 bucket_bytes: float) -> None:
        self.work = work
        self._encoded = np.array([kind in GEMM_KINDS for kind in work.kinds], bool)
        self._held_gradients = np.cumsum(_gradient_bytes_by_first_reader(work, params)[::-1])[::-1]
        gradients = float(params.loc[params["requires_grad"], "bytes"].sum())
        self._master_bytes = float(params["bytes"].sum())
        self._bucket_bytes = float(bucket_bytes)
        self._optimizer_bytes = optimizer_state_count(optimizer) * gradients
        self._shared = _SharedTensors(work)
        self._keeps_fp32 = np.array([keep_format(kind, Precision.BF16) is Precision.FP32
                                     for kind in work.kinds], bool)
        self._internal_grads = _internal_gradient_bytes(work)
        self._batched: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def saved(self, assignment: PrecisionAssignment, *, batch_size: int,
              split_shared: bool = False, emulated: bool = False) -> np.ndarray:
        """Per op, the bytes of activations it holds for backward until its backward has
        run (a tensor several ops keep as it is counted at the first of them): their sum
        is everything a training step saves. With ``split_shared`` such a tensor counts
        in even parts at each of them instead (wholly at its writer when the writer keeps
        it, as a ReLU does): each op's share of the sum, which the allocator weighs per
        op. ``emulated``: as :func:`memory_breakdown`."""
        scale, own_fp32, _ = self._at_batch(batch_size)
        keep, written = self._formats(assignment, emulated)
        stored_bits = self._stored_bits(assignment)
        return own_fp32 * stored_bits / 32 + self._shared.held(keep, written, scale,
                                                               split=split_shared)

    def weight_copies(self, assignment: PrecisionAssignment) -> np.ndarray:
        """Per op, the bytes of the low-precision weight copy it encodes for forward and
        keeps until its backward has run (GEMM-shaped ops not stored in fp32)."""
        stored_bits = self._stored_bits(assignment)
        return np.where(stored_bits < 32, self.work.weight_numel * stored_bits / 8, 0.0)

    def breakdown(self, assignment: PrecisionAssignment, *, batch_size: int,
                  emulated: bool = False) -> dict[str, float]:
        """Bytes per component of :data:`MEMORY_COMPONENTS` for one rank (``emulated``: as
        :func:`memory_breakdown`)."""
        scale, _, transient_fp32 = self._at_batch(batch_size)
        saved = self.saved(assignment, batch_size=batch_size, emulated=emulated)
        copies = self.weight_copies(assignment)
        if emulated:  # fp32 gradients, and a GEMM's encoded operands widened for backward
            widened = self.work.act_read_bytes * scale + self.work.weight_numel * 4.0
            transient = transient_fp32 + np.where(copies > 0, widened, 0.0)
        else:
            transient = transient_fp32 * bits_ratio([_STORAGE[q] for q in assignment.backward])
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

    def _formats(self, assignment: PrecisionAssignment,
                 emulated: bool) -> tuple[np.ndarray, np.ndarray]:
        """Per op, the storage format (a code) it keeps its saved float operands in
        (:func:`keep_format`) and the one it writes its output in; emulated, every output
        and every operand but a GEMM's encoded ones in fp32."""
        fp32 = _FORMAT[Precision.FP32]
        keep = np.where(self._keeps_fp32 | (emulated & ~self._encoded), fp32,
                        [_STORAGE_FORMAT[p] for p in assignment.precision])
        written = np.full(len(keep), fp32) if emulated else np.array(
            [_STORAGE_FORMAT[p] for p in assignment.output])
        return keep, written

    def _stored_bits(self, assignment: PrecisionAssignment) -> np.ndarray:
        """Per op, the bits it stores its saved operands in (32 but for encoded kinds)."""
        return np.where(self._encoded, [_STORED_BITS[p] for p in assignment.precision], 32.0)

    def _at_batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per op at ``batch_size``: its activation scale, the fp32 bytes it saves for
        itself alone, and its output gradient and input gradient (and any gradient inside
        it) together, in fp32."""
        if batch_size not in self._batched:
            work = self.work
            scale = batch_scales(work, batch_size)
            self._batched[batch_size] = (
                scale, self._shared.own_bytes * scale,
                (work.out_bytes + work.act_read_bytes + self._internal_grads) * scale)
        return self._batched[batch_size]


def _internal_gradient_bytes(work: OpWork) -> np.ndarray:
    """Per op, fp32 bytes of a gradient its backward makes inside it, alive with its input
    gradient: cross-entropy (log-softmax then negative log-likelihood) turns the output
    gradient into one of the log-probabilities, then that into the logits' gradient, each
    the size of the logits."""
    internal = np.zeros(len(work))
    for i, (kind, target, shapes) in enumerate(zip(work.kinds, work.targets,
                                                   work.input_shapes)):
        if kind == "loss" and _is_cross_entropy(target) and shapes:
            internal[i] = 4.0 * float(np.prod(shapes[0], dtype=float))
    return internal


def _is_cross_entropy(target: str) -> bool:
    name = target.rsplit(".", 1)[-1].lower()
    return name in ("cross_entropy", "crossentropyloss")


class _SharedTensors:
    """The saved activations of a graph that several ops may keep, and what each op keeps
    alone, so that a tensor kept as it is by several ops is held once.

    A tensor is stored in its writer's output format (``assignment.output``; fp32 for a
    graph input). An op that keeps its saved operands in that same format keeps the tensor
    itself; one that keeps them in another (a bf16 GEMM reading fp32, an fp32 norm reading
    a bf16 GEMM's output) keeps its own copy of what it reads in its format. A tensor
    several ops keep itself is counted once, at the first of them in forward order:
    backward runs the ops in reverse, so that one's backward is the last to need it (or
    split evenly among them, see :meth:`MemoryModel.saved`).
    """

    def __init__(self, work: OpWork) -> None:
        ops, owners, storage, view, floats = [], [], [], [], []
        listed = np.zeros(len(work))
        for i, entries in enumerate(work.saved_tensors):
            for owner, storage_bytes, view_bytes, is_float in entries:
                ops.append(i)
                # a tensor is its owner op; a graph input one tensor of its own (negative)
                owners.append(-1 - len(owners) if owner is None else owner)
                storage.append(storage_bytes)
                view.append(view_bytes)
                floats.append(bool(is_float))
                listed[i] += view_bytes
        #: per op, fp32 bytes at the traced batch it saves for itself alone
        self.own_bytes = np.maximum(work.saved_bytes - listed, 0.0)
        order = np.lexsort((np.array(ops, int), np.array(owners, int)))  # tensor, then op
        self.ops = np.array(ops, int)[order]
        self.owners = np.array(owners, int)[order]
        self.storage = np.array(storage, float)[order]
        self.view = np.array(view, float)[order]
        self.floats = np.array(floats, bool)[order]
        self.own_output = self.owners == self.ops
        first = np.r_[True, self.owners[1:] != self.owners[:-1]] if len(order) else \
            np.zeros(0, bool)
        #: per row, its tensor's number and the row that tensor's rows start at
        self.group = np.cumsum(first) - 1
        self.group_start = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
        self.num_ops = len(work)

    def held(self, keep: np.ndarray, written: np.ndarray, scale: np.ndarray, *,
             split: bool = False) -> np.ndarray:
        """Per op, the bytes of these tensors it holds (``split``: its share of those it
        keeps with others).

        Args:
            keep: per op, the storage format it keeps its saved float operands in (a
                :data:`_FORMAT` code).
            written: per op, the storage format of its output (a code).
            scale: per op, its activations' batch scale (a tensor scales as its owner's
                output, a graph input as the op reading it).
        """
        if not len(self.ops):
            return np.zeros(self.num_ops)
        is_input = self.owners < 0
        owner = np.maximum(self.owners, 0)
        stored = np.where(is_input, _FORMAT[Precision.FP32], written[owner])
        kept = keep[self.ops]
        as_is = ~self.floats | self.own_output | (kept == stored)
        if split:  # evenly among the ops keeping it as it is, unless its writer keeps it
            keepers = np.bincount(self.group, weights=as_is)[self.group]
            writer_keeps = np.bincount(self.group, weights=self.own_output)[self.group] > 0
            share = np.where(writer_keeps, self.own_output, 1.0 / np.maximum(keepers, 1))
        else:  # at the first op keeping it as it is
            count = np.cumsum(as_is)
            share = count - count[self.group_start] + as_is[self.group_start] == 1
        op_scale = scale[self.ops]
        tensor_bytes = self.storage * np.where(is_input, op_scale, scale[owner]) * np.where(
            self.floats, _FORMAT_BITS[stored] / 32, 1.0)
        copy_bytes = self.view * op_scale * _FORMAT_BITS[kept] / 32
        held = np.where(as_is, share * tensor_bytes, copy_bytes)
        return np.bincount(self.ops, weights=held, minlength=self.num_ops)


def _gradient_bytes_by_first_reader(work: OpWork, params: pd.DataFrame) -> np.ndarray:
    """Per op, the fp32 gradient bytes of the parameters it is the first to read (where
    DDP's buckets place them too); a parameter no traced op reads counts at op 0."""
    position = {name: i for i, name in enumerate(work.names)}
    by_op = np.zeros(len(work))
    trainable = params[params["requires_grad"]]
    for op, nbytes in zip(trainable["first_op"], trainable["bytes"]):
        by_op[position.get(op, 0)] += nbytes
    return by_op
