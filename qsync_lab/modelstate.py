"""Run code on a model and leave it exactly as it was.

Example::

    >>> import torch, torch.nn as nn
    >>> bn = nn.BatchNorm1d(3)
    >>> with preserved_state(bn):
    ...     _ = bn(torch.randn(4, 3))       # updates running stats in train mode
    >>> bn.running_mean.tolist()
    [0.0, 0.0, 0.0]
"""

import torch
import torch.nn as nn


class preserved_state:
    """Context manager restoring buffers (BatchNorm running stats), train/eval flags and the
    parameters' ``.grad`` of ``model`` on exit, so tracing or profiling changes nothing."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> "preserved_state":
        self.buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        self.modes = {n: m.training for n, m in self.model.named_modules()}
        self.grads = {n: None if p.grad is None else p.grad.detach().clone()
                      for n, p in self.model.named_parameters()}
        return self

    def __exit__(self, *exc) -> bool:
        with torch.no_grad():
            for n, b in self.model.named_buffers():
                b.copy_(self.buffers[n])
        for n, m in self.model.named_modules():
            m.training = self.modes[n]
        for n, p in self.model.named_parameters():
            p.grad = self.grads[n]
        return False
