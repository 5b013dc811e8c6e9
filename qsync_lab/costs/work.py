"""The work each operator does per phase: FLOPs and bytes at a precision and a batch size.

An :class:`~qsync_lab.graph.OpGraph` is traced at one batch size. This module turns its
per-op columns into flat arrays once (:func:`op_work`) and answers, for any per-rank batch
size and per-op precision, how many FLOPs and bytes each op's forward, input-gradient and
weight-gradient pass costs (:func:`phase_work`).

Batch scaling (explicit, as every consumer relies on it):

* The *traced batch size* is dim 0 of the model's first example input
  (:attr:`OpGraph.batch_size <qsync_lab.graph.OpGraph>`); for a graph without it, dim 0 of
  the first input of the graph's first op that computes something (views and factories
  are skipped: BERT's first op is a ``narrow`` of the ``position_ids`` buffer, whose dim
  0 is 1, not the batch). Pass ``traced_batch_size`` to :func:`op_work` to override it.
* An op is *batched* when one of its input or output tensors has that size in dim 0, or
  when it reads a batched op's output (:func:`batch_sized`: a sequence model's loss reads
  ``(batch * tokens, vocabulary)`` logits). Its FLOPs and activation bytes (inputs,
  outputs, saved tensors) scale linearly with ``batch_size / traced_batch_size``;
  parameter bytes never scale. Ops on buffers (BERT's position embedding, shape ``(1,
  seq, hidden)``) do not scale. Trace with a batch size (≥ 2) that no other leading
  dimension shares, or every op with dim 0 = 1 counts as batched.

Bytes per precision: a tensor held in precision ``p`` takes ``bits(p) / 32`` of its traced
(fp32) size; int8 ops write fp32 outputs (int32 accumulate, dequantised), and index tensors
(embedding inputs) are scaled like the rest, which slightly under-counts them.

Backward bytes (no column of the graph counts them; the roofline needs them):

* input gradient: read the output gradient, the weights and the saved input, write the
  input gradient (``out + weight + 2 * act_in`` bytes);
* weight gradient: read the output gradient and the saved input, write the weight
  gradient (an embedding writes its whole dense gradient table);
* a backward phase without FLOPs (``add``, factories, ops on data) runs no kernel, so
  it moves no bytes either.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.graph import trace_graph
    >>> work = op_work(trace_graph(nn.Linear(4, 2), torch.randn(3, 4)))
    >>> work.traced_batch_size, work.names
    (3, ('linear',))
    >>> flops, nbytes = phase_work(work, ["fp16"], "forward", batch_size=6)
    >>> int(flops[0]), int(nbytes[0])   # 2x the traced work; bytes at 16 of 32 bits
    (108, 92)
"""

import difflib
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision

__all__ = ["PHASES", "OpWork", "batch_scales", "batch_sized", "bits_ratio", "op_work",
           "phase_work", "shape_key", "traced_batch_size", "unknown_op_message"]

#: the three compute phases of an operator, in the order they run
PHASES = ("forward", "backward_input", "backward_weight")
_SKIP_FOR_BATCH = frozenset({"view", "factory"})
_BITS_FP32 = 32


@dataclass(frozen=True, eq=False)
class OpWork:
    """Per-op work of one graph as flat arrays, in execution order.

    Attributes:
        names: op FQNs.
        kinds: op kinds.
        targets: the called module class or function, per op.
        plan_refusals: why a plan cannot set each op ("" when it can).
        producers: indices of the ops each op reads (data edges).
        fwd_flops, bwd_input_flops, bwd_weight_flops: FLOPs at the traced batch.
        act_read_bytes: activation bytes read forward (inputs, not parameters), fp32.
        weight_bytes: parameter bytes of the op, fp32.
        weight_read_bytes: parameter bytes read forward (0 for embeddings, which read
            only the gathered rows, counted in ``act_read_bytes``).
        out_bytes: bytes of the outputs at the traced batch, fp32.
        out_numel: elements of the first output at the traced batch.
        weight_numel: parameter elements of the op.
        saved_bytes: bytes kept for backward at the traced batch, fp32.
        float_output: whether the first output is a floating-point tensor.
        data_input_numel: float elements the op reads straight from graph inputs when it
            has no producer op (0 otherwise).
        saved_tensors: per op, the activations it keeps for backward that other ops may
            keep too (:func:`qsync_lab.graph.opgraph.saved_tensors`), ``(owner,
            storage_bytes, view_bytes, is_float)`` per tensor at the traced batch, ``owner``
            the index of the op that wrote it (None: a graph input).
        batched: whether the op's work and activations scale with the batch size
            (:func:`batch_sized`).
        input_shapes, weight_shapes: traced shapes (for :func:`shape_key`).
        traced_batch_size: the batch size the graph was traced at.
    """

    names: tuple[str, ...]
    kinds: tuple[str, ...]
    targets: tuple[str, ...]
    plan_refusals: tuple[str, ...]
    producers: tuple[tuple[int, ...], ...]
    fwd_flops: np.ndarray
    bwd_input_flops: np.ndarray
    bwd_weight_flops: np.ndarray
    act_read_bytes: np.ndarray
    weight_bytes: np.ndarray
    weight_read_bytes: np.ndarray
    out_bytes: np.ndarray
    out_numel: np.ndarray
    weight_numel: np.ndarray
    saved_bytes: np.ndarray
    saved_tensors: tuple[tuple[tuple[int | None, int, int, bool], ...], ...]
    float_output: np.ndarray
    data_input_numel: np.ndarray
    batched: np.ndarray
    input_shapes: tuple[tuple[tuple[int, ...], ...], ...]
    weight_shapes: tuple[tuple[tuple[int, ...], ...], ...]
    traced_batch_size: int

    def __len__(self) -> int:
        return len(self.names)

    @functools.cached_property
    def consumers(self) -> tuple[tuple[int, ...], ...]:
        """Indices of the ops that read each op (the data edges the other way)."""
        readers: list[list[int]] = [[] for _ in self.names]
        for i, producers in enumerate(self.producers):
            for j in producers:
                readers[j].append(i)
        return tuple(tuple(r) for r in readers)

    def index_of(self, fqn: str) -> int:
        """Position of op ``fqn``; QSyncError naming close matches if unknown."""
        try:
            return self.names.index(fqn)
        except ValueError:
            raise QSyncError(unknown_op_message(fqn, self.names)) from None


def traced_batch_size(graph) -> int:
    """The batch size ``graph`` was traced at (see the module docstring for the rule).

    Example::

        >>> import torch, torch.nn as nn
        >>> from qsync_lab.graph import trace_graph
        >>> traced_batch_size(trace_graph(nn.Sequential(nn.Flatten(), nn.Linear(12, 2)),
        ...                               torch.randn(5, 3, 4)))
        5
    """
    if getattr(graph, "batch_size", None):
        return graph.batch_size
    ops = graph.ops
    for kind, shapes in zip(ops["kind"], ops["input_shapes"]):
        if kind not in _SKIP_FOR_BATCH and shapes and len(shapes[0]) > 0:
            return int(shapes[0][0])
    raise QSyncError("cannot infer the traced batch size: no op reads a batched input; "
                     "pass traced_batch_size explicitly")


def op_work(graph, *, traced_batch_size: int | None = None) -> OpWork:
    """Flatten ``graph.ops`` into an :class:`OpWork` (do it once per graph).

    Args:
        graph: an :class:`~qsync_lab.graph.OpGraph`.
        traced_batch_size: the batch size of the trace (default: inferred, see the module
            docstring).
    """
    batch = traced_batch_size if traced_batch_size is not None else _infer(graph)
    if batch < 1:
        raise QSyncError(f"traced_batch_size must be a positive integer, got {batch}")
    ops = graph.ops
    names = tuple(ops.index)
    position = {name: i for i, name in enumerate(names)}
    kinds = tuple(ops["kind"])
    weight_bytes = np.array([_nbytes(s, d) for s, d in zip(ops["weight_shapes"],
                                                           ops["weight_dtypes"])], float)
    weight_read = np.where(np.array(kinds) == "embedding", 0.0, weight_bytes)
    input_shapes = tuple(tuple(tuple(s) for s in shapes) for shapes in ops["input_shapes"])
    output_shapes = tuple(tuple(tuple(s) for s in shapes) for shapes in ops["output_shapes"])
    producers = tuple(tuple(position[p] for p in inputs) for inputs in ops["inputs"])
    data_numel = [
        sum(_numel(s) for s, d in zip(shapes, dtypes) if _is_float(d)) if not prods else 0
        for shapes, dtypes, prods in zip(input_shapes, ops["input_dtypes"], producers)
    ]
    return OpWork(
        names=names,
        kinds=kinds,
        targets=tuple(str(t) for t in ops["target"]),
        plan_refusals=tuple(str(r) for r in ops["plan_refusal"]),
        producers=producers,
        fwd_flops=ops["fwd_flops"].to_numpy(float),
        bwd_input_flops=ops["bwd_input_flops"].to_numpy(float),
        bwd_weight_flops=ops["bwd_weight_flops"].to_numpy(float),
        act_read_bytes=ops["bytes_read"].to_numpy(float) - weight_read,
        weight_bytes=weight_bytes,
        weight_read_bytes=weight_read,
        out_bytes=ops["bytes_written"].to_numpy(float),
        out_numel=np.array([_numel(s[0]) if s else 0 for s in output_shapes], float),
        weight_numel=np.array([sum(_numel(s) for s in shapes)
                               for shapes in ops["weight_shapes"]], float),
        saved_bytes=ops["saved_bytes"].to_numpy(float),
        saved_tensors=tuple(tuple((None if owner is None else position[owner], storage, view,
                                   is_float) for owner, storage, view, is_float in kept)
                            for kept in ops["saved_tensors"]),
        float_output=np.array([bool(d) and _is_float(d[0]) for d in ops["output_dtypes"]]),
        data_input_numel=np.array(data_numel, float),
        batched=batch_sized([any(len(s) > 0 and s[0] == batch for s in (*ins, *outs))
                             for ins, outs in zip(input_shapes, output_shapes)], producers),
        input_shapes=input_shapes,
        weight_shapes=tuple(tuple(tuple(s) for s in shapes) for shapes in ops["weight_shapes"]),
        traced_batch_size=int(batch),
    )


def batch_sized(leading: Sequence[bool], producers: Sequence[Sequence[int]]) -> np.ndarray:
    """Per op (in execution order), whether its work grows with the batch: ``leading`` (a
    tensor of it has the batch as its first dimension) or an op it reads does. The second
    catches tensors whose first dimension folds the batch with another one, as a sequence
    model's loss reads ``(batch * tokens, vocabulary)`` logits.

    Example::

        >>> batch_sized([True, False, False, False], [(), (0,), (1,), ()]).tolist()
        [True, True, True, False]
    """
    batched = np.array(leading, bool)
    for i, reads in enumerate(producers):
        batched[i] = batched[i] or any(batched[p] for p in reads)
    return batched


def batch_scales(work: OpWork, batch_size: int) -> np.ndarray:
    """Per-op factor on activation quantities at ``batch_size`` (1 for unbatched ops).

    Example::

        >>> import torch, torch.nn as nn
        >>> from qsync_lab.graph import trace_graph
        >>> batch_scales(op_work(trace_graph(nn.Linear(4, 2), torch.randn(2, 4))), 8).tolist()
        [4.0]
    """
    if batch_size < 1:
        raise QSyncError(f"batch size must be a positive integer, got {batch_size}")
    return np.where(work.batched, batch_size / work.traced_batch_size, 1.0)


def bits_ratio(precisions: Sequence["Precision | str"]) -> np.ndarray:
    """``bits(p) / 32`` per precision.

    Example::

        >>> bits_ratio(["fp32", "fp16", Precision.INT8]).tolist()
        [1.0, 0.5, 0.25]
    """
    bits = {p: Precision.parse(p).bits for p in set(precisions)}
    return np.array([bits[p] for p in precisions], float) / _BITS_FP32


def phase_work(work: OpWork, precisions: Sequence["Precision | str"], phase: str, *,
               batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """FLOPs and bytes of every op in ``phase`` at ``batch_size``.

    Args:
        work: from :func:`op_work`.
        precisions: per op, the precision the phase computes in (for an int8 op's
            backward pass that is fp16, see :data:`qsync_lab.policy.DEFAULT_BACKWARD`).
        phase: one of :data:`PHASES`.
        batch_size: the per-rank batch size.

    Returns:
        ``(flops, bytes)`` arrays, one entry per op.
    """
    if len(precisions) != len(work):
        raise QSyncError(f"need one precision per op ({len(work)}), got {len(precisions)}")
    scale = batch_scales(work, batch_size)
    ratio = bits_ratio(precisions)
    act_in, out = work.act_read_bytes * scale, work.out_bytes * scale
    if phase == "forward":
        is_int8 = {p: Precision.parse(p) is Precision.INT8 for p in set(precisions)}
        out_ratio = np.where([is_int8[p] for p in precisions], 1.0, ratio)
        return (work.fwd_flops * scale,
                (act_in + work.weight_read_bytes) * ratio + out * out_ratio)
    if phase == "backward_input":
        flops = work.bwd_input_flops * scale
        return flops, np.where(flops > 0, (out + work.weight_bytes + 2 * act_in) * ratio, 0.0)
    if phase == "backward_weight":
        flops = work.bwd_weight_flops * scale
        return flops, np.where(flops > 0, (out + act_in + work.weight_bytes) * ratio, 0.0)
    raise QSyncError(f"unknown phase {phase!r}; choose one of: {', '.join(PHASES)}")


def shape_key(work: OpWork, index: int, batch_size: int) -> str:
    """The (kind, shapes) key a profile row matches when its FQN does not: the op kind,
    its input shapes at ``batch_size`` and its weight shapes.

    Example::

        >>> import torch, torch.nn as nn
        >>> from qsync_lab.graph import trace_graph
        >>> shape_key(op_work(trace_graph(nn.Linear(4, 2), torch.randn(3, 4))), 0, 32)
        'linear|32x4|w:2x4,2'
    """
    traced = work.traced_batch_size
    batched = bool(work.batched[index])

    def fmt(shape: tuple[int, ...], scale_dim0: bool) -> str:
        dims = list(shape)
        if scale_dim0 and dims and dims[0] == traced:
            dims[0] = batch_size
        return "x".join(str(d) for d in dims)

    inputs = ",".join(fmt(s, batched) for s in work.input_shapes[index])
    weights = ",".join(fmt(s, False) for s in work.weight_shapes[index])
    return f"{work.kinds[index]}|{inputs}|w:{weights}"


def unknown_op_message(fqn: str, names: Sequence[str]) -> str:
    """One line saying ``fqn`` is not an op of the graph, with the closest FQNs.

    Example::

        >>> unknown_op_message("fc3", ["fc1", "relu"])
        "unknown op 'fc3'; did you mean fc1? (op names are graph.ops.index)"
    """
    close = difflib.get_close_matches(fqn, names, n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return f"unknown op {fqn!r}; {hint}(op names are graph.ops.index)"


def _infer(graph) -> int:
    return traced_batch_size(graph)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _nbytes(shapes, dtypes) -> int:
    return sum(_numel(s) * getattr(torch, d).itemsize for s, d in zip(shapes, dtypes))


def _is_float(dtype: str) -> bool:
    return "float" in dtype
