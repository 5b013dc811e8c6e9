"""Several ranks on one GPU: SM partitions (green contexts) and the MPS daemon that runs them
at once.

A cluster may give a GPU rank a share of its GPU's multiprocessors (``sms = 16`` in its
device group, :mod:`qsync_lab.cluster`): one GPU then plays a fast device and a slow one
with real tensor cores. Each such rank enters a green context of that many SMs before any
CUDA work (:func:`enter_sm_partition`) and makes the context's stream its current stream,
so its kernels, forward and backward (autograd runs each backward op on its forward's
stream), stay on its SMs. Two processes on one GPU take turns unless NVIDIA's
Multi-Process Service runs: :func:`mps_daemon` starts one for a run when none is running,
stops it afterwards, and refuses in one line where it cannot. NCCL takes one rank per GPU,
so ranks that share a GPU talk over gloo (:func:`backend_for`).

Example::

    >>> backend_for([0, 1], cuda=True), backend_for([0, 0], cuda=True)
    ('nccl', 'gloo')
"""

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from qsync_lab.errors import QSyncError

__all__ = ["MPS_CONTROL", "backend_for", "enter_sm_partition", "mps_daemon", "mps_running",
           "shared_gpus"]

MPS_CONTROL = "nvidia-cuda-mps-control"
_DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
_START_WAIT_S = 10.0
_partitions: list = []  # the green contexts entered by this process (kept alive)


def shared_gpus(gpu_of_rank: Sequence[int]) -> list[int]:
    """The GPU indices that more than one of a node's ranks use.

    Example::

        >>> shared_gpus([0, 0, 1]), shared_gpus([0, 1])
        ([0], [])
    """
    return sorted({g for g in gpu_of_rank if list(gpu_of_rank).count(g) > 1})


def backend_for(gpu_of_rank: Sequence[int], *, cuda: bool) -> str:
    """The process group's backend: NCCL for CUDA ranks with a GPU each, else gloo (NCCL
    refuses two ranks on one device; gloo moves CUDA tensors through the host)."""
    return "nccl" if cuda and not shared_gpus(gpu_of_rank) else "gloo"


def enter_sm_partition(num_sms: int, device_index: int):
    """Run this process's CUDA work on ``num_sms`` SMs of GPU ``device_index``, from now on.

    Creates a green context (``torch.cuda.green_contexts``) and makes its stream the
    current stream (or, on torch versions whose green contexts have no stream, makes the
    context current). Returns the context.

    Raises:
        QSyncError: this torch has no green contexts, or the GPU cannot make that partition.
    """
    import torch

    try:
        from torch.cuda.green_contexts import GreenContext
    except ImportError:
        raise QSyncError(f"torch {torch.__version__} has no green contexts "
                         "(torch.cuda.green_contexts): partitioned GPUs need torch 2.10 or "
                         "newer; give each rank a GPU of its own (drop sms)") from None
    try:
        context = GreenContext.create(num_sms=num_sms, device_id=device_index)
    except (RuntimeError, TypeError) as err:
        raise QSyncError(f"cannot make a green context of {num_sms} SMs on GPU "
                         f"{device_index}: {str(err).splitlines()[0]}") from None
    if hasattr(context, "Stream"):
        torch.cuda.set_stream(context.Stream())
    else:
        context.set_context()
    _partitions.append(context)
    return context


def _pipe_directory() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", _DEFAULT_PIPE_DIRECTORY))


def mps_running() -> bool:
    """Whether an MPS control daemon listens (its control pipe exists)."""
    return (_pipe_directory() / "control").exists()


@contextlib.contextmanager
def mps_daemon(shared: Sequence[int]) -> Iterator[str]:
    """Make sure MPS runs while the block runs, when ranks share the GPUs ``shared``.

    Yields what was done: ``"not needed"``, ``"already running"`` or ``"started"``; a daemon
    this started is stopped when the block ends, however it ends.

    Raises:
        QSyncError: GPUs are shared and MPS is neither running nor startable here.
    """
    if not shared:
        yield "not needed"
        return
    if mps_running():
        yield "already running"
        return
    control = shutil.which(MPS_CONTROL)
    gpus = ", ".join(map(str, shared))
    if control is None:
        raise QSyncError(f"ranks share GPU {gpus}, which runs their processes at once only "
                         f"under NVIDIA MPS, and {MPS_CONTROL} is not on PATH: start MPS "
                         "(as root), or give each rank a GPU of its own")
    done = subprocess.run([control, "-d"], capture_output=True, text=True)
    if done.returncode != 0 or not _wait_for(mps_running, _START_WAIT_S):
        reason = (done.stderr or done.stdout).strip().splitlines()
        raise QSyncError(f"could not start MPS for the ranks sharing GPU {gpus} "
                         f"({reason[0] if reason else f'exit {done.returncode}'}); it needs "
                         "root: start it yourself, or give each rank a GPU of its own")
    try:
        yield "started"
    finally:
        subprocess.run([control], input="quit\n", capture_output=True, text=True)
        _wait_for(lambda: not mps_running(), _START_WAIT_S)


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
