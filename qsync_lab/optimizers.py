"""The optimizers a run can train with, and the fp32 state each keeps per parameter.

The runtime builds them (:func:`qsync_lab.runtime.trainer.make_optimizer`), a plan records
which one its run uses, and the memory model counts its state.

Example::

    >>> optimizer_state_count("sgd_momentum"), optimizer_state_count("adam")
    (1, 2)
"""

from collections.abc import Mapping
from types import MappingProxyType

from qsync_lab.errors import QSyncError

__all__ = ["DEFAULT_OPTIMIZER", "OPTIMIZER_STATES", "optimizer_state_count"]

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
