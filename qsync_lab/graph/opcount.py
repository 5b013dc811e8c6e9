"""FLOPs, bytes moved and bytes saved for backward, per operator record.

Conventions (documented once, used by every cost consumer):

* A multiply-accumulate is 2 FLOPs. GEMM-like ops (linear, conv, matmul) count
  ``2·MACs`` forward, ``2·MACs`` for the input gradient (per operand that needs one)
  and ``2·MACs`` for the weight gradient; a bias adds one FLOP per output element
  forward and one per output element to the weight gradient. A linear op with one weight
  matrix per output (an attention in-projection with separate query, key and value
  weights) computes output ``i`` with weight ``i``.
* An op whose inputs are all graph inputs (data) computes no input gradient, as autograd
  does not (the first conv of a CNN has ``bwd_input_flops == 0``).
* The kinds of :data:`~qsync_lab.graph.kinds.COUNTED_KINDS` (attention, transposed
  convolution, recurrent layers, contractions, unknown calls) take their forward FLOPs
  from ``torch.utils.flop_counter`` (``OpRecord.counted_fwd_flops``) and, as every GEMM,
  twice that backward: a weight gradient equal to the forward when the op holds
  parameters, the rest for input gradients (attention's four backward GEMMs against its
  two forward ones). They save their inputs; attention also its output and log-sum-exp
  rows (the core of a multi-head attention module what the tracer worked out,
  ``OpRecord.saved_bytes``: :func:`qsync_lab.graph.attention.core_saved_bytes`), and
  recurrent layers per token and layer-direction the floats of ``RECURRENT_SAVED_FLOATS``
  (measured with ``saved_tensors_hooks`` on CPU).
* Element-wise kinds use nominal FLOPs per element (table ``ELEMENTWISE_FLOPS``); they
  are memory-bound, so the cost model relies on their bytes, not these numbers.
* ``bytes_read`` counts activation inputs plus parameters, ``bytes_written`` the outputs;
  view ops move nothing.
* Bytes saved for backward follow what PyTorch autograd keeps: inputs of GEMMs, the
  output of softmax, ReLU, sigmoid and tanh (the input of other activations), a dropout
  mask (1 byte per element on CUDA, whose fused kernel keeps a bool mask; the input's dtype
  on CPU), input + statistics for norms, input + int64 indices for max-pooling. They are
  per op: a tensor several ops keep (a ReLU's output that the next Linear saves too) is
  in each one's ``saved_bytes``, and held once in
  :func:`qsync_lab.graph.opgraph.saved_tensors` and the memory model.

Example::

    >>> import torch
    >>> from qsync_lab.graph.records import OpRecord, TensorMeta
    >>> x = TensorMeta((8, 64), torch.float32)
    >>> rec = OpRecord("fc", "linear", "torch.nn.Linear", [x], ["prev"],
    ...                [TensorMeta((8, 32), torch.float32)],
    ...                [("fc.weight", TensorMeta((32, 64), torch.float32))])
    >>> c = count_op(rec)
    >>> c.fwd_flops, c.bwd_input_flops, c.bwd_weight_flops, c.saved_bytes
    (32768, 32768, 32768, 2048)
"""

from dataclasses import dataclass

from qsync_lab.graph.kinds import COUNTED_KINDS
from qsync_lab.graph.records import OpRecord
from qsync_lab.policy import GEMM_KINDS, NORM_KINDS

#: nominal (forward, backward) FLOPs per output element of element-wise kinds
ELEMENTWISE_FLOPS = {
    "activation": (1, 1),
    "transcendental": (8, 8),
    "softmax": (5, 4),
    "batch_norm": (5, 8),
    "layer_norm": (5, 8),
    "group_norm": (5, 8),
    "rms_norm": (4, 6),
    "dropout": (2, 1),
    "add": (1, 0),
    "mul": (1, 1),
    "elementwise": (1, 1),
    "loss": (4, 2),
    "resample": (1, 1),
}

#: gates per cell (LSTM 4, GRU 3, RNN 1) -> floats autograd keeps per token and layer-direction,
#: as (per hidden unit, per input feature); least squares over 1-2 layers, uni- and
#: bidirectional, hidden 32-64, measured on CPU (torch 2.13), within 7 %
RECURRENT_SAVED_FLOATS = {4: (16.0, 4.0), 3: (7.0, 0.5), 1: (1.2, 0.5)}

_TRANSCENDENTAL = frozenset({"gelu", "tanh", "sigmoid", "silu", "elu", "mish", "softplus"})
#: activations whose backward reads their output; the others (GELU, SiLU, ReLU6, ...) their input
_SAVE_OUTPUT = frozenset({"relu", "sigmoid", "tanh"})


@dataclass(frozen=True)
class OpCounts:
    """Counts for one operator (see the module docstring for the conventions)."""

    fwd_flops: int
    bwd_input_flops: int
    bwd_weight_flops: int
    bytes_read: int
    bytes_written: int
    saved_inputs: tuple[int, ...]  # indices into ``OpRecord.inputs`` kept for backward
    saved_extra_bytes: int  # tensors only the op itself keeps: masks, statistics, indices
    saved_bytes: int  # saved inputs + saved output + extra
    #: bytes of the op's own first output kept for backward (ReLU, softmax, attention), a
    #: tensor the ops reading it may keep too
    saved_output_bytes: int = 0


def count_op(rec: OpRecord, device_type: str = "cuda") -> OpCounts:
    """Return the FLOPs and bytes of one recorded operator when run on ``device_type``."""
    if rec.kind == "view":
        return OpCounts(0, 0, 0, 0, 0, (), 0, 0)
    fwd, bwd_in, bwd_w, saved, extra = _count(rec, device_type)
    output = 0
    if isinstance(extra, _Output):  # the op keeps its own output (and maybe more)
        output, extra = extra.output, extra.rest
    if rec.input_ops and all(src is None for src in rec.input_ops):
        bwd_in = 0
    read = sum(t.nbytes for t in rec.inputs) + sum(m.nbytes for _, m in rec.params)
    written = sum(t.nbytes for t in rec.outputs)
    if rec.kind == "embedding":  # reads only the gathered rows of the table
        read = sum(t.nbytes for t in rec.inputs) + written
    saved_total = sum(rec.inputs[i].nbytes for i in saved) + output + extra
    return OpCounts(int(fwd), int(bwd_in), int(bwd_w), read, written, saved, int(extra),
                    int(saved_total), int(output))


@dataclass(frozen=True)
class _Output:
    """What ``_count`` returns as saved extra bytes when the op keeps its own output:
    the output's bytes and those of the other tensors it keeps."""

    output: int
    rest: int = 0


def _count(rec: OpRecord, device_type: str) -> tuple[int, int, int, tuple[int, ...], int]:
    """(fwd, bwd_input, bwd_weight, saved input indices, saved extra bytes); the extra
    bytes are an :class:`_Output` when they include the op's own output."""
    out_numel = sum(t.numel for t in rec.outputs)
    out_bytes = sum(t.nbytes for t in rec.outputs)
    if rec.kind in GEMM_KINDS:
        return _count_gemm(rec, out_numel)
    if rec.kind in COUNTED_KINDS:
        return _count_counted(rec)
    if rec.kind == "embedding":
        return 0, 0, out_numel, (0,), 0
    if rec.kind == "pool":
        in_numel = rec.inputs[0].numel if rec.inputs else 0
        indices = 8 * out_numel if "max" in rec.target.lower() else 0
        return in_numel, in_numel, 0, (0,), indices
    if rec.kind == "reduce":
        in_numel = sum(t.numel for t in rec.inputs)
        return in_numel, in_numel, 0, (), 0
    if rec.kind in ("copy", "factory", "other"):
        return 0, 0, 0, (), 0
    kind = rec.kind
    if kind == "activation" and _short_name(rec.target) in _TRANSCENDENTAL:
        kind = "transcendental"
    per_fwd, per_bwd = ELEMENTWISE_FLOPS[kind]
    fwd, bwd = per_fwd * out_numel, per_bwd * out_numel
    bias_grad = out_numel if rec.params else 0  # affine norms: d(weight), d(bias)
    if kind == "softmax" or (kind in ("activation", "transcendental")
                             and _short_name(rec.target) in _SAVE_OUTPUT):
        first = rec.outputs[0].nbytes if rec.outputs else 0
        return fwd, bwd, 0, (), _Output(first, out_bytes - first)
    if kind in ("activation", "transcendental"):
        return fwd, bwd, 0, (0,) if rec.inputs else (), 0
    if kind in NORM_KINDS:
        return fwd, bwd, bias_grad, (0,), _norm_stats_bytes(rec)
    if kind == "dropout":
        mask_itemsize = 1 if device_type == "cuda" else rec.outputs[0].dtype.itemsize
        return fwd, bwd, 0, (), out_numel * mask_itemsize
    if kind == "loss":
        return fwd, bwd, 0, tuple(range(1, len(rec.inputs))), rec.inputs[0].nbytes
    if kind == "mul":
        tensor_operands = len(rec.inputs)
        saved = tuple(range(tensor_operands)) if tensor_operands > 1 else ()
        return fwd, bwd * tensor_operands, 0, saved, 0
    if kind == "add":
        return fwd, 0, 0, (), 0
    if kind == "resample":  # backward needs the sizes only
        return fwd, bwd, 0, (), 0
    return fwd, bwd, 0, (0,) if rec.inputs else (), 0  # other element-wise math


def _short_name(target: str) -> str:
    """``torch.nn.modules.activation.GELU`` -> ``gelu``; ``gelu_`` -> ``gelu``."""
    return target.rsplit(".", 1)[-1].lower().strip("_")


def _count_gemm(rec: OpRecord, out_numel: int) -> tuple[int, int, int, tuple[int, ...], int]:
    weights = [m for _, m in rec.params if len(m.shape) >= 2]
    biases = [m for _, m in rec.params if len(m.shape) == 1]
    if rec.kind == "linear" and len(weights) == 1 == len(rec.inputs) == len(rec.outputs):
        # a linear map's input is (..., in_features), whichever way it stores its weight
        macs = out_numel * (rec.inputs[0].shape[-1] if rec.inputs[0].shape else 1)
        bias = out_numel if biases else 0
        return 2 * macs + bias, 2 * macs, 2 * macs + bias, (0,), 0
    if weights:  # a weighted layer: activation input(s) x weight
        # in_features, or C_in/groups * prod(kernel); output i of weight i when there are
        # as many (an attention in-projection's separate query, key and value weights)
        pairs = zip(rec.outputs, weights) if len(weights) == len(rec.outputs) else \
            ((out, weights[0]) for out in rec.outputs)
        macs = sum(out.numel * (w.numel // w.shape[0]) for out, w in pairs)
        bias = out_numel if biases else 0
        return 2 * macs + bias, 2 * macs, 2 * macs + bias, tuple(range(len(rec.inputs))), 0
    a = rec.inputs[0]
    reduce_dim = a.shape[-1] if a.shape else 1
    macs = out_numel * reduce_dim
    operands = len(rec.inputs)
    return 2 * macs, 2 * macs * operands, 0, tuple(range(operands)), 0


def _count_counted(rec: OpRecord) -> tuple[int, int, int, tuple[int, ...], int]:
    fwd = rec.counted_fwd_flops or 0
    if fwd == 0:  # nothing torch counts: data movement or unknown math, nothing saved
        return 0, 0, 0, (), 0
    weight_grad = fwd if rec.params else 0
    extra = 0
    saved = tuple(range(len(rec.inputs)))
    if rec.saved_bytes is not None:  # worked out by the tracer
        extra, saved = rec.saved_bytes, ()
    elif rec.kind == "attention":  # its output and fp32 log-sum-exp rows
        out = rec.outputs[0]
        rows = 4 * out.numel // max(1, out.shape[-1] if out.shape else 1)
        if rec.params:  # an unsplit nn.MultiheadAttention: its projections and inner output
            extra = 4 * out.nbytes + rows  # (its own output is the out-projection's)
        else:  # F.scaled_dot_product_attention: the output the next op reads, as a view
            extra = _Output(out.nbytes, rows)
    elif rec.kind == "recurrent":
        extra = _recurrent_saved_bytes(rec)
    return fwd, 2 * fwd - weight_grad, weight_grad, saved, extra


def _recurrent_saved_bytes(rec: OpRecord) -> int:
    """What an RNN/GRU/LSTM keeps per step: ``RECURRENT_SAVED_FLOATS`` per layer-direction."""
    cells = [m for name, m in rec.params if name.rsplit(".", 1)[-1].startswith("weight_ih")]
    hidden = [m for name, m in rec.params if name.rsplit(".", 1)[-1].startswith("weight_hh")]
    if not cells or not hidden or not rec.inputs:
        return 0
    x = rec.inputs[0]
    tokens = x.numel // max(1, cells[0].shape[1])
    floats = 0.0
    for w_ih, w_hh in zip(cells, hidden):
        size = w_hh.shape[1]
        per_hidden, per_input = RECURRENT_SAVED_FLOATS.get(w_ih.shape[0] // size, (1.0, 1.0))
        floats += per_hidden * size + per_input * w_ih.shape[1]
    itemsize = x.dtype.itemsize if x.dtype.is_floating_point else 4
    return int(tokens * floats * itemsize)


def _norm_stats_bytes(rec: OpRecord) -> int:
    """Bytes of the statistics a norm saves (fp32 mean and inverse std)."""
    x = rec.inputs[0]
    if rec.kind == "batch_norm":
        groups = x.shape[1] if len(x.shape) > 1 else x.shape[0]
    else:
        normalized = rec.params[0][1].numel if rec.params else (x.shape[-1] if x.shape else 1)
        groups = max(1, x.numel // max(1, normalized))
    stats = 1 if rec.kind == "rms_norm" else 2
    return 4 * stats * groups
