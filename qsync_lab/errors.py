"""The one exception type qsync_lab raises for bad input.

Every message is a single line that says what is wrong and what to do about it, so the
CLI can print it as is and a notebook user can act on it without reading a traceback.

Example::

    >>> from qsync_lab.errors import QSyncError
    >>> try:
    ...     raise QSyncError("unknown model 'resnet5'; choose one of: resnet18, resnet50")
    ... except ValueError as err:
    ...     print(err)
    unknown model 'resnet5'; choose one of: resnet18, resnet50
"""


class QSyncError(ValueError):
    """Bad input to qsync_lab (a ValueError, so callers may catch either)."""
