"""What a run writes in its folder, and the check that none of it is a symlink.

A symlink at an output (or at the ``ranks`` folder) would take a write, or a checkpoint
read at ``--resume``, outside the folder the user chose: :func:`check_outputs` refuses it
before anything is written, in ``qsync-lab run``'s checks and on every rank before the
first step; the writers refuse it again (:mod:`qsync_lab.io`).

Example::

    >>> import pathlib, tempfile
    >>> from qsync_lab.errors import QSyncError
    >>> run_dir = pathlib.Path(tempfile.mkdtemp())
    >>> check_outputs(run_dir)   # nothing there yet: fine
    >>> (run_dir / RANKS).symlink_to(tempfile.mkdtemp())
    >>> try:
    ...     check_outputs(run_dir)
    ... except QSyncError as err:
    ...     print(str(err).replace(str(run_dir), "RUN"))
    refusing to write through the symlink RUN/ranks; remove it or choose another path
"""

import os
import re
from pathlib import Path

from qsync_lab.io import check_no_symlink

__all__ = ["CHECKPOINT_GLOB", "FINAL", "LOG_NAME", "METRICS", "RANKS", "SUMMARY",
           "check_outputs", "saved_checkpoints"]

SUMMARY = "summary.json"
FINAL = "final.safetensors"
METRICS = "metrics.jsonl"
LOG_NAME = "launch.log"
RANKS = "ranks"  # a folder: each rank's pid file
CHECKPOINT_GLOB = "checkpoint-*"
_CHECKPOINT_NAME = re.compile(r"checkpoint-(\d{8,})\.safetensors")


def check_outputs(run_dir: "str | os.PathLike[str]") -> None:
    """Raise if an output of ``run_dir`` (summary, final weights, metrics, launch log, the
    ``ranks`` folder or a file in it, a checkpoint) is a symlink; ``run_dir`` itself may be
    one.

    Raises:
        QSyncError: the first symlink found, in one line.
    """
    run_dir = Path(run_dir)
    for name in (SUMMARY, FINAL, METRICS, LOG_NAME, RANKS):
        check_no_symlink(run_dir / name)
    for path in (*run_dir.glob(CHECKPOINT_GLOB), *(run_dir / RANKS).glob("*")):
        check_no_symlink(path)


def saved_checkpoints(run_dir: "str | os.PathLike[str]") -> list[tuple[int, Path]]:
    """(step, path) of the run folder's checkpoints by their names (not verified), newest
    first; anything else named like one (a FIFO, a folder) is left out."""
    found = ((_CHECKPOINT_NAME.fullmatch(path.name), path)
             for path in Path(run_dir).glob(CHECKPOINT_GLOB))
    return sorted(((int(match[1]), path) for match, path in found
                   if match and path.is_file()), reverse=True)
