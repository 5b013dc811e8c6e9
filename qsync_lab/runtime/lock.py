"""One run per directory: an exclusive OS lock on ``<run_dir>/.qsync.lock``.

:func:`acquire_run_lock` takes the lock (``flock``) and writes its holder (host, pid, start
time) into the file as JSON; a second taker fails at once, naming the holder. The OS
releases the lock when every descriptor of it is closed, so a holder that crashed or was
killed leaves a free lock behind: the next taker takes it over, with a
:class:`RunLockTakeoverWarning` naming the previous holder. A holder that lets go cleanly
(:meth:`RunLock.release`, :func:`forget_ended_holder`) leaves no record and so no note.

The launcher hands the descriptor to torchrun (``pass_fds``, :meth:`RunLock.hand_over`),
so the lock lives exactly as long as torchrun, and sets ``QSYNC_RUN_LOCK=held`` for the
ranks; a rank 0 started by torchrun directly takes the lock itself
(:func:`lock_for_this_process`).

Example::

    >>> import os, tempfile
    >>> run_dir = tempfile.mkdtemp()
    >>> with acquire_run_lock(run_dir):
    ...     try:
    ...         acquire_run_lock(run_dir)
    ...     except QSyncError as err:
    ...         print(f"run directory {run_dir} is in use by pid {os.getpid()} on host" in
    ...               str(err))
    True
"""

import datetime
import errno
import fcntl
import json
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qsync_lab.errors import QSyncError

__all__ = ["LOCK_ENV", "LOCK_HELD", "LOCK_NAME", "RunLock", "RunLockTakeoverWarning",
           "acquire_run_lock", "check_run_dir_free", "forget_ended_holder",
           "lock_for_this_process"]

LOCK_NAME = ".qsync.lock"
LOCK_ENV = "QSYNC_RUN_LOCK"  # set to LOCK_HELD for the ranks of a launch that holds the lock
LOCK_HELD = "held"
_RECORD_LIMIT_BYTES = 4096


class RunLockTakeoverWarning(UserWarning):
    """A run directory's lock was free but named a previous holder (which has ended)."""


@dataclass
class RunLock:
    """A held run-directory lock: its file and the descriptor that holds it.

    The descriptor is a plain OS one: dropping this object does not release the lock;
    :meth:`release` (or leaving a ``with`` block, or the end of the process) does.
    """

    path: Path
    fd: int

    def record(self, pid: int) -> None:
        """Name ``pid`` on this host, since now, as the holder."""
        holder = {"host": socket.gethostname(), "pid": pid,
                  "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        data = json.dumps(holder).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    def release(self) -> None:
        """Let go: clear the holder record (a holder that ends cleanly leaves none behind)
        and close this process's descriptor (the lock is free once no process holds one)."""
        if self.fd >= 0:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)
            self.fd = -1

    def hand_over(self, pid: int) -> None:
        """Name ``pid`` as the holder and close this process's descriptor, keeping the
        record: process ``pid`` (torchrun, started with ``pass_fds``) holds the lock now."""
        self.record(pid)
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire_run_lock(run_dir: "str | os.PathLike[str]", *, note: bool = True) -> RunLock:
    """Lock ``run_dir`` (created if missing) for this process, recorded as the holder; a
    :class:`RunLockTakeoverWarning` names a previous holder that ended without letting go
    (``note=False``: none).

    Raises:
        QSyncError: another process holds the lock (named in the message), or the lock
            file cannot be opened (e.g. it is a symlink).
    """
    run_dir = Path(run_dir)
    path = run_dir / LOCK_NAME
    fd = _locked_descriptor(run_dir, path)
    previous = _holder(fd)
    lock = RunLock(path, fd)
    lock.record(os.getpid())
    if previous and note:
        warnings.warn(f"took over the lock of run directory {run_dir} from "
                      f"{_describe(previous)}, which has ended", RunLockTakeoverWarning,
                      stacklevel=2)
    return lock


def check_run_dir_free(run_dir: "str | os.PathLike[str]") -> None:
    """Raise if another run holds ``run_dir`` (before writing into it, e.g. its plan);
    the lock itself is left as it was.

    Raises:
        QSyncError: as :func:`acquire_run_lock`.
    """
    run_dir = Path(run_dir)
    os.close(_locked_descriptor(run_dir, run_dir / LOCK_NAME))


def _locked_descriptor(run_dir: Path, path: Path) -> int:
    """A descriptor of the lock file ``path`` that holds its lock (created if missing)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise QSyncError(f"refusing to use the symlink {path} as the run lock; remove it "
                             "or choose another --run-dir") from None
        raise QSyncError(f"cannot open the run lock {path}: {err.strerror}; choose a "
                         "--run-dir you can write") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise QSyncError(f"run directory {run_dir} is in use by {_describe(holder)}; wait for "
                         "it or choose another --run-dir") from None
    return fd


def lock_for_this_process(run_dir: "str | os.PathLike[str]") -> RunLock | None:
    """For a rank 0 that torchrun started directly: lock ``run_dir`` for as long as this
    process lives, or until :meth:`RunLock.release` (release it, or use it as a context
    manager, where the process lives on after the run, e.g. ``train`` in a notebook); None
    when the launcher already holds the lock for the ranks (``QSYNC_RUN_LOCK=held``).

    Raises:
        QSyncError: another run holds the lock (see :func:`acquire_run_lock`).
    """
    if os.environ.get(LOCK_ENV) == LOCK_HELD:
        return None
    return acquire_run_lock(run_dir)


def forget_ended_holder(run_dir: "str | os.PathLike[str]") -> None:
    """Clear the record of a holder that has ended normally (torchrun after a finished run,
    which never lets go itself), so the next run takes the lock without a note; nothing to
    do while another run holds the lock."""
    try:
        lock = acquire_run_lock(run_dir, note=False)
    except QSyncError:
        return
    lock.release()


def _holder(fd: int) -> dict[str, Any]:
    """The holder recorded in the lock file (empty if none or unreadable)."""
    try:
        holder = json.loads(os.pread(fd, _RECORD_LIMIT_BYTES, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    """``pid 123 on host h since <time>``, from what the record has."""
    if "pid" not in holder:
        return "another process (which has not recorded itself yet)"
    return (f"pid {holder['pid']} on host {holder.get('host', '?')} since "
            f"{holder.get('since', '?')}")
