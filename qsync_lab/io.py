"""Writing files safely: atomically, and never through a symlink.

A result is either fully written or not there at all (:func:`atomic_write_text`,
:func:`atomic_write_bytes`); a log that grows while a run goes on is opened with
:func:`open_log`. None of them writes through a symlink at the path, nor (given the folder
the user chose, ``within``) through a symlinked folder inside it: that would put the output
wherever the link points, outside the folder the user chose (:func:`check_no_symlink`).

Example::

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "plan.json"
    >>> atomic_write_text(path, '{"ok": true}')
    >>> path.read_text()
    '{"ok": true}'
    >>> (path.parent / "link.json").symlink_to(path)
    >>> try:
    ...     atomic_write_text(path.parent / "link.json", "{}")
    ... except QSyncError as err:
    ...     print(str(err).replace(str(path.parent), "DIR"))
    refusing to write through the symlink DIR/link.json; remove it or choose another path
"""

import errno
import os
import tempfile
from pathlib import Path
from typing import TextIO

from qsync_lab.errors import QSyncError

__all__ = ["atomic_write_bytes", "atomic_write_text", "check_no_symlink", "open_log"]


def atomic_write_text(path: "str | os.PathLike[str]", text: str, *,
                      within: "str | os.PathLike[str] | None" = None) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder and a rename
    (``within``: as :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode("utf-8"), within=within)


def atomic_write_bytes(path: "str | os.PathLike[str]", data: bytes, *,
                       within: "str | os.PathLike[str] | None" = None) -> None:
    """Write ``data`` to ``path`` atomically (temp file + fsync + ``os.replace``), with the
    mode a plain ``open`` would give it (the umask's); ``within``: the folder the user
    chose, in which no folder on the way to ``path`` may be a symlink.

    Raises:
        QSyncError: ``path`` is a symlink (the rename would replace it silently), or a
            folder between ``within`` and it is.
    """
    target = Path(path)
    check_no_symlink(target, within=within)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), 0o666 & ~_umask())
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_log(path: "str | os.PathLike[str]") -> TextIO:
    """``path`` opened for writing text from its start, unless it is a symlink.

    Raises:
        QSyncError: ``path`` is a symlink.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _symlink_error(Path(path)) from None
        raise
    return os.fdopen(fd, "w", encoding="utf-8")


def check_no_symlink(path: "str | os.PathLike[str]", *,
                     within: "str | os.PathLike[str] | None" = None) -> None:
    """Raise if ``path``, or a folder between ``within`` and it, is a symlink.

    Raises:
        QSyncError: the symlink, in one line.
    """
    path = Path(path)
    depth = 0 if within is None else len(path.relative_to(within).parts) - 1
    for part in (path, *list(path.parents)[:depth]):
        if part.is_symlink():
            raise _symlink_error(part)


def _symlink_error(path: Path) -> QSyncError:
    return QSyncError(f"refusing to write through the symlink {path}; remove it or choose "
                      "another path")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
