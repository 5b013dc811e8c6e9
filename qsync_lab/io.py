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

__all__ = ["atomic_write_bytes", "atomic_write_text", "check_no_symlink", "check_output_dir",
           "check_output_file", "open_log"]


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
    if target.exists() and not target.is_file():  # the rename would replace a device, a pipe
        raise _not_a_file(target, "")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as err:
        raise QSyncError(f"cannot write {target}: {err.strerror or err}; choose another "
                         "path") from None
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


def check_output_file(path: "str | os.PathLike[str]", flag: str, *,
                      inputs: "tuple[str | os.PathLike[str] | None, ...]" = ()) -> Path:
    """``path``, once it is sure that a command may write its output file there (``flag``:
    how the user gave it), before any work: it is named, is no folder, pipe, device or
    symlink, its folder is or can be made, and it is none of the command's ``inputs``.

    Example: ``check_output_file("plan.json", "--out", inputs=("cpu.csv",))``.

    Raises:
        QSyncError: what is wrong with it, in one line.
    """
    if not str(path):
        raise QSyncError(f"{flag} is empty; name the file to write")
    target = Path(path)
    if target.is_symlink():
        raise _symlink_error(target)
    if target.exists() and not target.is_file():
        raise _not_a_file(target, f"{flag} ")
    _check_creatable(target.parent, f"{flag} {target}", flag)
    for given in inputs:
        if given and target.exists() and Path(given).exists() and target.samefile(given):
            raise QSyncError(f"{flag} {target} is also an input of this command: writing "
                             f"would replace it; choose another {flag}")
    return target


def check_output_dir(path: "str | os.PathLike[str]", flag: str) -> Path:
    """``path``, once it is sure that it is, or can be made, a folder to write in
    (``flag``: how the user gave it).

    Raises:
        QSyncError: it is empty, a file or under one, or cannot be made; one line.
    """
    if not str(path):
        raise QSyncError(f"{flag} is empty; name a folder (. for this one)")
    _check_creatable(Path(path), f"{flag} {path}", flag)
    return Path(path)


def _check_creatable(folder: Path, what: str, flag: str) -> None:
    """Raise unless ``folder`` is, or can be made, a folder this process writes in: its
    nearest existing ancestor is a folder it may write in."""
    existing = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise QSyncError(f"{what}: {existing} is a file, not a folder; choose another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise QSyncError(f"{what}: cannot write in {existing} (no permission); choose another "
                         f"{flag}")


def _not_a_file(path: Path, flag: str) -> QSyncError:
    kind = "a folder" if path.is_dir() else "not a regular file (a pipe or a device)"
    return QSyncError(f"{flag}{path} is {kind}; name a file to write")


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
