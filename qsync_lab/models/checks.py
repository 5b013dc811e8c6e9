"""Validation of model and batch arguments; every failure is a one-line QSyncError."""

from qsync_lab.errors import QSyncError


def positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an integer >= 1, else raise QSyncError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise QSyncError(f"{name} must be a positive integer, got {value!r}; pass a whole number >= 1")
    return value


def probability(name: str, value: object) -> float:
    """Return ``value`` as a float if it lies in [0, 1), else raise QSyncError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise QSyncError(f"{name} must be a number in [0, 1), got {value!r}; pass e.g. {name}=0.1")
    return float(value)
