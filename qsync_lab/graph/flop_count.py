"""Forward FLOPs of one call as ``torch.utils.flop_counter`` counts them, on meta tensors.

The op kinds whose FLOPs follow from shapes alone (linear, conv, matmul, element-wise) are
counted by the rules of :mod:`qsync_lab.graph.opcount`. The others (attention, transposed
convolution, recurrent layers, einsum-like contractions and unknown calls) are counted by
running the call once more on ``meta`` tensors under
:class:`~torch.utils.flop_counter.FlopCounterMode`: no arithmetic, and the meta device
takes the dense composite path (on CPU, fused attention and RNN kernels count 0 FLOPs).

Example::

    >>> import torch, torch.nn.functional as F
    >>> q = torch.randn(2, 4, 16, 8)
    >>> counted_forward_flops(F.scaled_dot_product_attention, (q, q, q), {})  # 2 GEMMs
    65536
"""

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode


def counted_forward_flops(call, args: tuple, kwargs: dict, *,
                          module: nn.Module | None = None) -> int | None:
    """FLOPs of ``call(*args, **kwargs)`` (or of ``module`` called so) on meta tensors.

    Tensors may be real, fake or meta; only shapes and dtypes are read. Returns None when
    the call cannot run on the meta device (an op without a meta kernel).
    """
    meta_args, meta_kwargs = tree_map(_to_meta, (args, kwargs))
    try:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            if module is None:
                call(*meta_args, **meta_kwargs)
            else:
                params = {name: _to_meta(t) for name, t in
                          [*module.named_parameters(), *module.named_buffers()]}
                functional_call(module, params, meta_args, meta_kwargs)
    except Exception:  # no meta kernel, or a data-dependent op: unknown, not zero
        return None
    return int(counter.get_total_flops())


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty(tuple(int(s) for s in value.shape), dtype=value.dtype,
                           device="meta")
    return value
