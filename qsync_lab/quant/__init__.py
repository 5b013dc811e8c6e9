"""Low-precision training operators and ``apply_plan_`` (QSync's LP-PyTorch backend).

A plan maps op FQNs to precisions; ``apply_plan_`` makes each operator train in its
precision, in place, keeping parameters and state_dict keys. What a plan may set is the
policy's decision (:mod:`qsync_lab.policy`); this package carries it out:

* linear, conv1d/2d/3d, matmul and embedding ops (``QLinear``, ``QConv2d``, ``QMatMul``,
  ``QEmbedding``, ...; functional ``torch.matmul``/``@``/``bmm``/``F.linear`` calls through
  :mod:`~qsync_lab.quant.functional`). int8 follows QSync: int8×int8→int32 forward with
  per-tensor or per-channel scales and a dequantized fp32 output, backward in fp16 (or
  bf16/tf32/fp32) into the fp32 master weights, int8 codes saved for backward.
* the in- and out-projections of ``nn.MultiheadAttention`` (``attn.in_proj``,
  ``attn.out_proj``) run as linears, its attention core in fp32
  (:mod:`~qsync_lab.quant.attention`).
* norms run in fp32, fp16 or bf16 (fp16/bf16 I/O, fp32 math).
* On CUDA the native kernels run (``torch._int_mm``, ``torch._scaled_mm``, fp16/bf16 GEMMs);
  on the CPU an exact fp32 emulation of the same numerics (``gemm.py``).

Example::

    >>> import torch
    >>> from qsync_lab.quant import apply_plan_, describe_precisions
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> plan = {"0": "int8", "2": {"forward": "int8", "granularity": "channel"}}
    >>> apply_plan_(model, plan)
    >>> describe_precisions(model)[["kind", "forward", "backward", "granularity"]]
           kind forward backward granularity
    fqn
    0    linear    int8     fp16      tensor
    2    linear    int8     fp16     channel
    >>> model(torch.randn(4, 8)).sum().backward()
"""

from qsync_lab.quant.apply import (apply_plan_, describe_precisions, restore_rounding_counters,
                                   rounding_counters)
from qsync_lab.quant.functional import low_precision_call
from qsync_lab.quant.modules import (PrecisionBoundary, QConv1d, QConv2d, QConv3d, QEmbedding,
                                     QLinear, QMatMul)
from qsync_lab.quant.resolve import (apply_op_precision_, apply_resolved_plan_, function_runs_in,
                                     plan_keeps_tf32_on)

__all__ = [
    "PrecisionBoundary", "QConv1d", "QConv2d", "QConv3d", "QEmbedding", "QLinear", "QMatMul",
    "apply_op_precision_", "apply_plan_", "apply_resolved_plan_", "describe_precisions",
    "function_runs_in", "low_precision_call", "plan_keeps_tf32_on",
    "restore_rounding_counters", "rounding_counters",
]
