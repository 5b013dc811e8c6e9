"""The optimizers a run can train with, and the fp32 state each keeps per parameter.

The runtime builds them (:func:`make_optimizer`), a plan records which one its run uses,
and the memory model counts its state.

Example::

    >>> optimizer_state_count("sgd_momentum"), optimizer_state_count("adam")
    (1, 2)
"""

from collections.abc import Mapping
from types import MappingProxyType

from qsync_lab.errors import QSyncError

__all__ = ["DEFAULT_OPTIMIZER", "OPTIMIZER_STATES", "gradient_sums_finite", "make_optimizer",
           "optimizer_state_count"]

#: optimizer -> fp32 state tensors per parameter (momentum buffer; Adam's two moments)
OPTIMIZER_STATES: Mapping[str, int] = MappingProxyType(
    {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2})
#: the optimizer a run trains with unless told otherwise
DEFAULT_OPTIMIZER = "sgd_momentum"


def optimizer_state_count(optimizer: str) -> int:
    """fp32 state tensors per parameter of ``optimizer`` (QSyncError if unknown)."""
    if optimizer not in OPTIMIZER_STATES:
        raise QSyncError(f"unknown optimizer {optimizer!r}; choose one of: "
                         f"{', '.join(OPTIMIZER_STATES)}")
    return OPTIMIZER_STATES[optimizer]


def make_optimizer(name: str, parameters, *, lr: float, momentum: float = 0.9):
    """The torch optimizer called ``name`` (one of :data:`OPTIMIZER_STATES`).

    Example::

        >>> import torch
        >>> make_optimizer("sgd", [torch.nn.Parameter(torch.zeros(2))], lr=0.1).defaults["momentum"]
        0
    """
    import torch

    optimizer_state_count(name)  # QSyncError if unknown
    parameters = list(parameters)
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr)
    if name == "sgd_momentum":
        return torch.optim.SGD(parameters, lr=lr, momentum=momentum)
    if name == "adam":
        return torch.optim.Adam(parameters, lr=lr)
    return torch.optim.AdamW(parameters, lr=lr)


def gradient_sums_finite(gradients) -> bool:
    """Whether every gradient's sum of magnitudes is finite: the check a run makes before
    each optimizer step (a NaN or Inf anywhere makes its tensor's sum non-finite; one pass,
    fused over the tensors on a GPU by ``torch._foreach_norm``).

    Example::

        >>> import torch
        >>> gradient_sums_finite([torch.ones(3), torch.tensor([1.0, float("nan")])])
        False
    """
    import torch

    if not gradients:
        return True
    sums = torch.stack(torch._foreach_norm(list(gradients), 1)).float()
    return bool(torch.isfinite(sums).all())
