"""Building blocks shared by the zoo: the MatMul module and weight initialisation.

Example::

    >>> import torch
    >>> from qsync_lab.models.layers import MatMul
    >>> MatMul()(torch.ones(2, 3), torch.ones(3, 4)).shape
    torch.Size([2, 4])
"""

import torch
from torch import nn


class MatMul(nn.Module):
    """``torch.matmul(a, b)`` as a parameter-free module, so each matmul has its own FQN.

    ``op_kind`` tells ``qsync_lab.graph`` to treat it as one matmul operator
    (``qsync_lab.graph.symbolic_trace`` keeps it as a ``call_module`` node).
    """

    op_kind = "matmul"

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)


def init_conv_bn(model: nn.Module) -> None:
    """Kaiming-normal (fan_out, ReLU) conv weights, zero conv biases, BatchNorm weight 1 bias 0."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
