"""A dispatch mode that records the GEMM-like aten calls a model makes, with their operand
dtypes: which precision a matrix product or convolution really ran in, on any device."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GEMMS = {"mm", "addmm", "bmm", "_int_mm", "_scaled_mm", "convolution", "convolution_backward"}


class GemmCalls(TorchDispatchMode):
    """Records (aten op name, operand dtypes, TF32 switch: cuDNN's for convolutions,
    cuBLAS's for the others) of every GEMM-like call in ``calls``, and counts every aten
    call in ``count``."""

    def __init__(self):
        super().__init__()
        self.calls, self.count = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        name = func.overloadpacket.__name__
        if name in GEMMS:
            dtypes = tuple(a.dtype for a in args[:2] if isinstance(a, torch.Tensor))
            switch = torch.backends.cudnn if name.startswith("conv") else \
                torch.backends.cuda.matmul
            self.calls.append((name, dtypes, switch.allow_tf32))
        return func(*args, **(kwargs or {}))
