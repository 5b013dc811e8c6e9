"""``nn.MultiheadAttention`` with its projections in their planned precisions, its core in fp32.

The graph sees a multi-head attention module as three ops (:mod:`qsync_lab.graph.attention`);
a plan may set its two linear ones:

* ``<fqn>.out_proj`` is an ``nn.Linear`` submodule: it switches to its low-precision class
  like any linear (:class:`~qsync_lab.quant.QLinear`'s kernels);
* ``<fqn>.in_proj`` is no module: the attention module keeps its config in the plain
  attributes ``in_proj_precision``, ``in_proj_seed`` and ``in_proj_calls`` (a
  stochastic-rounding stream, as a low-precision module's ``op_seed``/``op_calls``), and
  runs each projection GEMM through the same autograd function as ``QLinear``
  (:func:`~qsync_lab.quant.functions.bilinear` with a
  :class:`~qsync_lab.quant.gemm.LinearKernel`).

While either projection runs below fp32, the module's class is its split class
(``QMultiheadAttention``), whose forward is
:func:`~qsync_lab.graph.attention.split_forward`: the in-projection at its precision, the
core in fp32 with torch's math (masks, key padding, ``need_weights``, dropout, both
layouts), ``out_proj`` called as a module. Back at fp32 for both, the module gets its torch
class again, and with it torch's forward, bit for bit. No parameter, buffer or state_dict
key changes.

Example::

    >>> import torch
    >>> from qsync_lab.quant import apply_plan_
    >>> mha = torch.nn.MultiheadAttention(8, 2)
    >>> apply_plan_(mha, {"in_proj": "int8", "out_proj": "fp16"})
    >>> type(mha).__name__, str(mha.in_proj_precision), type(mha.out_proj).__name__
    ('QMultiheadAttention', 'int8/fp16 nearest tensor', 'QNonDynamicallyQuantizableLinear')
    >>> x = torch.randn(5, 3, 8)
    >>> mha(x, x, x)[0].shape
    torch.Size([5, 3, 8])
    >>> apply_plan_(mha, {"in_proj": "fp32", "out_proj": "fp32"})
    >>> type(mha).__name__
    'MultiheadAttention'
"""

import zlib
from collections.abc import Iterator

import torch.nn.functional as F
from torch import nn

from qsync_lab.graph.attention import in_proj_name, split_forward, splits
from qsync_lab.policy import OpPrecision
from qsync_lab.quant.functions import bilinear
from qsync_lab.quant.gemm import LinearKernel
from qsync_lab.quant.modules import LowPrecisionOp, stream_seeds
from qsync_lab.quant.registry import FP32_OP, OpHandler

__all__ = ["InProjectionHandler", "attention_modules", "attention_refusal", "in_proj_precision",
           "projection_linear", "split_attention_class", "sync_attention_classes_"]

#: GEMMs of one in-projection at most (query, key, value), two operands each
_OPERANDS = 6


def projection_linear(cfg: OpPrecision, seeds: tuple[int, ...]):
    """``linear(x, weight, bias)`` computed in ``cfg`` (as ``QLinear``), for the GEMMs of an
    in-projection; the n-th GEMM rounds with ``seeds[2n]`` and ``seeds[2n + 1]``."""
    pairs = iter(zip(seeds[::2], seeds[1::2]))

    def linear(x, weight, bias):  # the core runs in fp32: a native 16-bit output widens
        return bilinear(LinearKernel(), x, weight, bias, cfg, next(pairs)).float()
    return linear


class _SplitAttentionForward:
    """The forward of ``nn.MultiheadAttention`` as three ops, its in-projection in
    ``in_proj_precision`` (when set)."""

    op_float_class: type

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True,
                attn_mask=None, average_attn_weights: bool = True, is_causal: bool = False):
        cfg = getattr(self, "in_proj_precision", None)
        if cfg is None:
            linear = F.linear
        else:
            call = self.in_proj_calls
            self.in_proj_calls = call + 1
            linear = projection_linear(cfg, stream_seeds(self.in_proj_seed, call, _OPERANDS))
        return split_forward(self, query, key, value, key_padding_mask, need_weights,
                             attn_mask, average_attn_weights, is_causal, linear=linear)


_SPLIT_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def split_attention_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The split class of attention class ``cls`` (``QMultiheadAttention``), made once."""
    if cls not in _SPLIT_CLASSES:
        _SPLIT_CLASSES[cls] = type(f"Q{cls.__name__}", (_SplitAttentionForward, cls), {
            "__module__": cls.__module__, "__doc__": cls.__doc__, "op_float_class": cls})
    return _SPLIT_CLASSES[cls]


def in_proj_precision(module: nn.Module) -> OpPrecision:
    """The config an attention module's in-projection runs in (fp32 when no plan set it)."""
    return getattr(module, "in_proj_precision", FP32_OP)


def _sync_class_(module: nn.Module) -> None:
    """The split class while a projection runs below fp32, else the torch class."""
    float_class = getattr(type(module), "op_float_class", type(module))
    low = hasattr(module, "in_proj_precision") or isinstance(module.out_proj, LowPrecisionOp)
    module.__class__ = split_attention_class(float_class) if low else float_class


class InProjectionHandler(OpHandler):
    """Sets the in-projection of an attention module (``<fqn>.in_proj``) to a config."""

    def apply(self, module, cfg, fqn):
        for name in ("in_proj_precision", "in_proj_seed", "in_proj_calls"):
            module.__dict__.pop(name, None)
        if not cfg.is_fp32:
            module.in_proj_precision = cfg
            module.in_proj_seed = zlib.crc32(fqn.encode())
            module.in_proj_calls = 0
        _sync_class_(module)


def attention_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(fqn, module)`` of every ``nn.MultiheadAttention`` of ``model``."""
    return ((fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.MultiheadAttention))


def sync_attention_classes_(model: nn.Module) -> None:
    """Give every split attention module of ``model`` the class its projections need (after
    an ``out_proj`` changed precision)."""
    for _, module in attention_modules(model):
        if splits(module):
            _sync_class_(module)


def attention_refusal(model: nn.Module, fqn: str) -> str | None:
    """Why a plan cannot set ``fqn`` if it names a projection of an attention module that
    runs as one op (``add_bias_kv``, ``add_zero_attn`` or a forward of its own); else None."""
    for name, module in attention_modules(model):
        if not splits(module) and fqn in (in_proj_name(name), f"{name}.out_proj".lstrip(".")):
            return (f"{type(module).__name__} {name or 'model'!r} has add_bias_kv, "
                    "add_zero_attn or its own forward, so it runs as one attention op in "
                    "fp32; its projections cannot be planned")
    return None
