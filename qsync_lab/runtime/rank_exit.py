"""Ending a rank's process once its run is written.

Example: ``train(config, task=task); exit_rank()`` as the last lines of a script that
torchrun starts.
"""

import os
import sys

__all__ = ["exit_rank"]


def exit_rank(status: int = 0) -> None:
    """End this process with ``status``, skipping the interpreter's teardown: destroying
    gloo's and OpenMP's thread pools in static destructors intermittently aborts a finished
    worker ("terminate called without an active exception", exit -6), which torchrun
    reports as a failed run. Everything a run writes is on disk (atomically) before
    :func:`~qsync_lab.runtime.train` returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
