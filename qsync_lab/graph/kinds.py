"""Operator kinds: which kind a module or function call is.

A module class may declare its own kind with a class attribute ``op_kind`` (the zoo's
``MatMul`` does), so user code can extend the table without touching this file; a module of
another class is the kind it computes, where the policy finds that by evidence
(:mod:`qsync_lab.policy.evidence`: library linear maps and norms).

Example::

    >>> import torch.nn as nn
    >>> module_kind(nn.Conv2d(3, 8, 3)), function_kind("softmax"), function_kind("reshape")
    ('conv2d', 'softmax', 'view')
    >>> module_kind(nn.LSTM(4, 8)), function_kind("scaled_dot_product_attention")
    ('recurrent', 'attention')
"""

import torch.nn as nn

from qsync_lab.graph.records import OpRecord, op_name_of
from qsync_lab.policy import PLANNABLE_KINDS, function_refusal, module_refusal
from qsync_lab.policy.evidence import computed_kind

#: kinds whose output aliases an input (no data movement, no FLOPs)
VIEW_KINDS = frozenset({"view"})

#: kinds whose FLOPs ``torch.utils.flop_counter`` counts at trace time (the shapes alone do
#: not say them): attention, transposed convolution, recurrent layers, einsum-like
#: contractions and calls of unknown kind
COUNTED_KINDS = frozenset({"attention", "conv_transpose", "recurrent", "contraction", "other"})

#: module class -> kind: the plannable kinds' torch classes (the policy's table), then the rest
_MODULE_KINDS: list[tuple[type, str]] = [
    *((rule.module_class, kind) for kind, rule in PLANNABLE_KINDS.items() if rule.torch_class),
    (nn.modules.conv._ConvTransposeNd, "conv_transpose"),
    (nn.MultiheadAttention, "attention"),
    (nn.RNNBase, "recurrent"),
    (nn.RNNCellBase, "recurrent"),
    (nn.Upsample, "resample"),
    (nn.Softmax, "softmax"),
    (nn.LogSoftmax, "softmax"),
    (nn.modules.pooling._MaxPoolNd, "pool"),
    (nn.modules.pooling._AvgPoolNd, "pool"),
    (nn.modules.pooling._AdaptiveAvgPoolNd, "pool"),
    (nn.modules.pooling._AdaptiveMaxPoolNd, "pool"),
    (nn.modules.dropout._DropoutNd, "dropout"),
    (nn.modules.loss._Loss, "loss"),
    (nn.Flatten, "view"),
    (nn.Unflatten, "view"),
    (nn.Identity, "view"),
    (nn.PixelShuffle, "copy"),
    (nn.PixelUnshuffle, "copy"),
    (nn.ZeroPad2d, "copy"),
]

_ACTIVATIONS = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU,
    nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Mish, nn.Softplus,
)

#: operator name -> kind: the calls the policy lets a plan set, then the rest
_FUNCTION_KINDS = {
    **{name: kind for kind, rule in PLANNABLE_KINDS.items() for name in rule.functions},
    "conv1d": "conv1d",
    "conv2d": "conv2d",
    "conv3d": "conv3d",
    "scaled_dot_product_attention": "attention",
    "mha_attention": "attention",  # nn.MultiheadAttention's core (qsync_lab.graph.attention)
    "conv_transpose1d": "conv_transpose",
    "conv_transpose2d": "conv_transpose",
    "conv_transpose3d": "conv_transpose",
    "einsum": "contraction",
    "baddbmm": "contraction",
    "addmm": "contraction",
    "addbmm": "contraction",
    "addmv": "contraction",
    "mv": "contraction",
    "tensordot": "contraction",
    "bilinear": "contraction",
    "interpolate": "resample",
    "upsample": "resample",
    "grid_sample": "resample",
    "pad": "copy",
    "repeat": "copy",
    "repeat_interleave": "copy",
    "tile": "copy",
    "roll": "copy",
    "flip": "copy",
    "pixel_shuffle": "copy",
    "embedding": "embedding",
    "batch_norm": "batch_norm",
    "layer_norm": "layer_norm",
    "group_norm": "group_norm",
    "rms_norm": "rms_norm",
    "softmax": "softmax",
    "log_softmax": "softmax",
    "dropout": "dropout",
    "cross_entropy": "loss",
    "nll_loss": "loss",
    "mse_loss": "loss",
    "l1_loss": "loss",
    "binary_cross_entropy_with_logits": "loss",
    "add": "add",
    "sub": "add",
    "mul": "mul",
    "div": "mul",
    "sum": "reduce",
    "mean": "reduce",
    "amax": "reduce",
    "cat": "copy",
    "stack": "copy",
    "contiguous": "copy",
    "clone": "copy",
}
for _name in ("relu", "relu6", "gelu", "silu", "tanh", "sigmoid", "leaky_relu", "elu",
              "hardswish", "hardsigmoid", "hardtanh", "mish", "softplus"):
    _FUNCTION_KINDS[_name] = "activation"
for _name in ("max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d",
              "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
              "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d"):
    _FUNCTION_KINDS[_name] = "pool"
for _name in ("view", "reshape", "flatten", "permute", "transpose", "t", "unsqueeze",
              "squeeze", "expand", "expand_as", "getitem", "split", "chunk", "narrow",
              "select", "unbind", "view_as", "unflatten", "movedim", "detach"):
    _FUNCTION_KINDS[_name] = "view"
for _name in ("zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like",
              "zeros", "ones", "full", "arange"):
    _FUNCTION_KINDS[_name] = "factory"
for _name in ("exp", "log", "sqrt", "rsqrt", "pow", "neg", "abs", "clamp", "erf",
              "masked_fill", "where", "float", "half", "to", "type_as", "tril", "triu",
              "normalize", "cumsum", "sin", "cos"):
    _FUNCTION_KINDS[_name] = "elementwise"


def module_kind(module: nn.Module) -> str | None:
    """Kind of a module called as one operator, or None if it is not a known op module."""
    declared = getattr(type(module), "op_kind", None)
    if declared is not None:
        return declared
    if isinstance(module, _ACTIVATIONS):
        return "activation"
    if isinstance(module, nn.modules.dropout._DropoutNd) and module.p == 0:
        return "view"  # an identity: no mask, no copy
    for cls, kind in _MODULE_KINDS:
        if isinstance(module, cls):
            return kind
    return computed_kind(module)


def function_kind(fn_name: str) -> str:
    """Kind of a function or tensor-method call (``'other'`` when unknown)."""
    return _FUNCTION_KINDS.get(op_name_of(fn_name), "other")


#: ``torch.nn`` modules made of other modules, traced through (their layers are ops)
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Transformer,
               nn.TransformerEncoder, nn.TransformerDecoder, nn.TransformerEncoderLayer,
               nn.TransformerDecoderLayer)


def is_leaf_module(module: nn.Module) -> bool:
    """True for modules traced as one operator: known op modules, modules declaring
    ``op_kind``, and any other module from ``torch.nn`` (as torch.fx does) but its
    containers and transformer layers."""
    if module_kind(module) is not None:
        return True
    return type(module).__module__.startswith("torch.nn") and not isinstance(
        module, _CONTAINERS)


def module_record(name: str, module: nn.Module) -> OpRecord:
    """The record of a module call: its kind, class and whether a plan can set it."""
    kind = module_kind(module)
    return OpRecord(name, kind or "other", f"{type(module).__module__}.{type(module).__name__}",
                    plan_refusal=module_refusal(module, kind) or "")


def gather_kind(rec: OpRecord) -> str:
    """``"copy"`` for an indexing call with an integer or boolean index tensor (a gather, as
    a relative-position-bias table is read: it copies), else the record's kind. The indexed
    tensor is the first input, or a parameter (then every input is an index); slicing an
    integer tensor (BERT's ``position_ids[:, :n]``) stays a view."""
    indices = rec.inputs if rec.params else rec.inputs[1:]
    if (rec.kind == "view" and op_name_of(rec.target) == "getitem"
            and any(not t.dtype.is_floating_point and not t.dtype.is_complex
                    for t in indices)):
        return "copy"
    return rec.kind


def function_record(name: str, fn_name: str) -> OpRecord:
    """The record of a function or tensor-method call."""
    kind = function_kind(fn_name)
    return OpRecord(name, kind, fn_name,
                    plan_refusal=function_refusal(op_name_of(fn_name), kind) or "")
