"""Mixed-precision training operators and ``apply_plan_`` (QSync's LP-PyTorch backend).

A plan maps op FQNs to precisions; ``apply_plan_`` makes each operator train in its
precision, in place, keeping parameters and state_dict keys:

* linear, conv2d, matmul and embedding run in fp32, tf32, bf16, fp16, int8 or fp8
  (``QLinear``, ``QConv2d``, ``QMatMul``, ``QEmbedding``). int8 follows QSync: int8×int8→int32
  forward with per-tensor or per-channel scales and a dequantized fp32 output, backward in
  fp16 (or bf16/tf32/fp32) into the fp32 master weights, int8 codes saved for backward.
* norms, softmax and activations run in fp32, fp16 or bf16.
* On CUDA the native kernels run (``torch._int_mm``, ``torch._scaled_mm``, fp16/bf16 GEMMs);
  on the CPU an exact fp32 emulation of the same numerics (``gemm.py``).

Training a plan on DDP ranks: ``torchrun … -m qsync_lab.runtime --plan plan.json`` (or
``qsync-lab run --plan plan.json``) calls :func:`train` on every rank — uneven per-rank
batches weighted to the global-batch gradient, ``metrics.jsonl``, atomic checkpoints and
exact resume, and a summary of measured against predicted step time
(:mod:`qsync_lab.runtime.trainer`). Your own model and data: a :class:`Task`.

Example::

    >>> import torch
    >>> from qsync_lab.runtime import apply_plan_, describe_precisions
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> plan = {"0": "int8", "1": "fp16", "2": {"forward": "int8", "granularity": "channel"}}
    >>> apply_plan_(model, plan)
    >>> describe_precisions(model)[["kind", "forward", "backward", "granularity"]]
              kind forward backward granularity
    fqn
    0       linear    int8     fp16      tensor
    1   activation    fp16     fp16      tensor
    2       linear    int8     fp16     channel
    >>> model(torch.randn(4, 8)).sum().backward()
"""

from qsync_lab.runtime.apply import apply_plan_, describe_precisions
from qsync_lab.runtime.config import OpPrecision
from qsync_lab.runtime.modules import PrecisionBoundary, QConv2d, QEmbedding, QLinear, QMatMul
from qsync_lab.runtime.registry import OpHandler, addressable_kinds, register_op_handler
from qsync_lab.runtime.tasks import Task, load_task
from qsync_lab.runtime.trainer import TrainConfig, train

__all__ = [
    "OpHandler",
    "OpPrecision",
    "PrecisionBoundary",
    "QConv2d",
    "QEmbedding",
    "QLinear",
    "QMatMul",
    "Task",
    "TrainConfig",
    "addressable_kinds",
    "apply_plan_",
    "describe_precisions",
    "load_task",
    "register_op_handler",
    "train",
]
