"""FLOPs, bytes moved and bytes saved for backward, per operator record.

Conventions (documented once, used by every cost consumer):

* A multiply-accumulate is 2 FLOPs. GEMM-like ops (linear, conv, matmul) count
  ``2·MACs`` forward, ``2·MACs`` for the input gradient (per operand that needs one)
  and ``2·MACs`` for the weight gradient; a bias adds one FLOP per output element
  forward and one per output element to the weight gradient.
* An op whose inputs are all graph inputs (data) computes no input gradient, as autograd
  does not (the first conv of a CNN has ``bwd_input_flops == 0``).
* Element-wise kinds use nominal FLOPs per element (table ``ELEMENTWISE_FLOPS``); they
  are memory-bound, so the cost model relies on their bytes, not these numbers.
* ``bytes_read`` counts activation inputs plus parameters, ``bytes_written`` the outputs;
  view ops move nothing.
* Bytes saved for backward follow what PyTorch autograd keeps: inputs of GEMMs, the
  output of softmax/ReLU-like activations, a dropout mask (1 byte per element on CUDA,
  whose fused kernel keeps a bool mask; the input's dtype on CPU), input + statistics for
  norms, input + int64 indices for max-pooling.

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

from qsync_lab.graph.records import OpRecord

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
}

_TRANSCENDENTAL = frozenset({"gelu", "tanh", "sigmoid", "silu", "elu", "mish", "softplus"})
_GEMM_KINDS = frozenset({"linear", "conv1d", "conv2d", "conv3d", "matmul"})


@dataclass(frozen=True)
class OpCounts:
    """Counts for one operator (see the module docstring for the conventions)."""

    fwd_flops: int
    bwd_input_flops: int
    bwd_weight_flops: int
    bytes_read: int
    bytes_written: int
    saved_inputs: tuple[int, ...]  # indices into ``OpRecord.inputs`` kept for backward
    saved_extra_bytes: int  # other tensors kept: outputs, masks, statistics, indices
    saved_bytes: int  # saved inputs + extra


def count_op(rec: OpRecord, device_type: str = "cuda") -> OpCounts:
    """Return the FLOPs and bytes of one recorded operator when run on ``device_type``."""
    if rec.kind == "view":
        return OpCounts(0, 0, 0, 0, 0, (), 0, 0)
    fwd, bwd_in, bwd_w, saved, extra = _count(rec, device_type)
    if rec.input_ops and all(src is None for src in rec.input_ops):
        bwd_in = 0
    read = sum(t.nbytes for t in rec.inputs) + sum(m.nbytes for _, m in rec.params)
    written = sum(t.nbytes for t in rec.outputs)
    if rec.kind == "embedding":  # reads only the gathered rows of the table
        read = sum(t.nbytes for t in rec.inputs) + written
    saved_total = sum(rec.inputs[i].nbytes for i in saved) + extra
    return OpCounts(int(fwd), int(bwd_in), int(bwd_w), read, written, saved, int(extra),
                    int(saved_total))


def _count(rec: OpRecord, device_type: str) -> tuple[int, int, int, tuple[int, ...], int]:
    """(fwd, bwd_input, bwd_weight, saved input indices, saved extra bytes)."""
    out_numel = sum(t.numel for t in rec.outputs)
    out_bytes = sum(t.nbytes for t in rec.outputs)
    if rec.kind in _GEMM_KINDS:
        return _count_gemm(rec, out_numel)
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
    if kind in ("activation", "transcendental", "softmax"):
        return fwd, bwd, 0, (), out_bytes
    if kind in ("batch_norm", "layer_norm", "group_norm", "rms_norm"):
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
    return fwd, bwd, 0, (0,) if rec.inputs else (), 0  # other element-wise math


def _short_name(target: str) -> str:
    """``torch.nn.modules.activation.GELU`` -> ``gelu``; ``gelu_`` -> ``gelu``."""
    return target.rsplit(".", 1)[-1].lower().strip("_")


def _count_gemm(rec: OpRecord, out_numel: int) -> tuple[int, int, int, tuple[int, ...], int]:
    weights = [m for _, m in rec.params if len(m.shape) >= 2]
    biases = [m for _, m in rec.params if len(m.shape) == 1]
    if weights:  # a weighted layer: activation input(s) x weight
        w = weights[0]
        reduce_dim = w.numel // w.shape[0]  # in_features, or C_in/groups * prod(kernel)
        macs = out_numel * reduce_dim
        bias = out_numel if biases else 0
        return 2 * macs + bias, 2 * macs, 2 * macs + bias, (0,), 0
    a = rec.inputs[0]
    reduce_dim = a.shape[-1] if a.shape else 1
    macs = out_numel * reduce_dim
    operands = len(rec.inputs)
    return 2 * macs, 2 * macs * operands, 0, tuple(range(operands)), 0


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
