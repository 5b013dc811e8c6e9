"""Several ranks on one GPU: SM partitions (green contexts) and the MPS daemon that runs them
at once.

A cluster may give a GPU rank a share of its GPU's multiprocessors (``sms = 16`` in its
device group, :mod:`qsync_lab.cluster`): one GPU then plays a fast device and a slow one
with real tensor cores. Each such rank enters a green context of its share before any CUDA
work (:func:`enter_sm_partition`) and makes the context's stream its current stream, so its
kernels, forward and backward (autograd runs each backward op on its forward's stream), stay
on its SMs; the shares of one GPU are carved apart, so no two ranks share an SM. Two
processes on one GPU take turns unless NVIDIA's Multi-Process Service runs:
:func:`mps_daemon` starts one for a run when none is running, stops it afterwards, and
refuses in one line where it cannot (``QSYNC_MPS=off``: the ranks take turns, no MPS). NCCL
takes one rank per GPU, so ranks that share a GPU talk over gloo (:func:`backend_for`).

Example::

    >>> backend_for([0, 1], cuda=True), backend_for([0, 0], cuda=True)
    ('nccl', 'gloo')
"""

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from qsync_lab.errors import QSyncError

__all__ = ["MPS_CONTROL", "MPS_ENV", "backend_for", "enter_sm_partition", "mps_control",
           "mps_daemon", "mps_running", "shared_gpus"]

MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_ENV = "QSYNC_MPS"  # "off": ranks that share a GPU take turns on it, without MPS
_DRIVER_BIN = "/usr/local/nvidia/bin"  # where some images keep the driver's programs
_DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
_DEFAULT_LOG_DIRECTORY = "/tmp/nvidia-mps-log"  # /var/log/nvidia-mps, MPS's own, may be read-only
_WAIT_S = 10.0
_partitions: list = []  # the green contexts made by this process (kept alive)


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


def enter_sm_partition(shares: Sequence[int], position: int, device_index: int) -> int | None:
    """Run this process's CUDA work, from now on, on ``shares[position]`` SMs of GPU
    ``device_index``, apart from the other shares' SMs: each rank on that GPU calls this with
    the same ``shares`` and its own ``position``.

    With cuda-python (``cuda.bindings``) every process carves the GPU's SMs alike
    (:func:`_carve`), each share rounded up to the driver's granule (8 SMs on Hopper), and
    makes the green context's stream its current stream. Without it (or where the driver
    refuses), torch's green contexts do it, whose partitions all begin at the same SMs: the
    shares then overlap, as a ``qsync_lab:`` note on stderr says.

    Example: ``enter_sm_partition([116, 16], 1, 0)`` on an H100 -> 16 (the slow rank's SMs).

    Returns:
        The SMs granted; None where torch made the green context (it does not say).

    Raises:
        QSyncError: this torch has no green contexts, or the GPU cannot make that partition.
    """
    import torch

    device = torch.device("cuda", device_index)
    try:
        from cuda.bindings import driver

        torch.empty(1, device=device)  # torch's primary context first: green ones come from it
        context, stream, granted = _carve(driver, shares, position, device_index)
        torch.cuda.set_stream(torch.cuda.ExternalStream(stream, device=device))
    except Exception as err:  # no cuda.bindings, or a driver that refuses: torch's way
        print(f"qsync_lab: the SM shares {list(shares)} of GPU {device_index} may overlap: "
              f"torch's green contexts make them ({_first_line(err)})", file=sys.stderr)
        context, granted = _torch_partition(shares[position], device_index), None
    _partitions.append(context)
    return granted


def _carve(driver, shares: Sequence[int], position: int,
           device_index: int) -> tuple[object, int, int]:
    """``(green context, its stream's handle, SMs granted)`` of share ``position``, made with
    ``driver`` (``cuda.bindings.driver``): the shares are carved out of the GPU's SMs smallest
    first (ties in position order), each from what the ones before left; where the shares
    fill the GPU, the largest takes every SM left."""
    _check(driver, driver.cuInit(0))
    device = _check(driver, driver.cuDeviceGet(device_index))
    sm = driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
    left = _check(driver, driver.cuDeviceGetDevResource(device, sm))
    fills = sum(shares) >= left.sm.smCount
    order = sorted(range(len(shares)), key=lambda i: (shares[i], i))
    for n, i in enumerate(order[:order.index(position) + 1]):
        if fills and i == order[-1]:
            mine = left
            continue
        if n:  # a split's remainder splits again only as a green context's own resource
            left = _check(driver, driver.cuGreenCtxGetDevResource(_green(driver, device, left),
                                                                  sm))
        groups, made, left = _check(driver, driver.cuDevSmResourceSplitByCount(
            1, left, 0, shares[i]))
        if not made:
            raise RuntimeError(f"no group of {shares[i]} SMs is left on GPU {device_index}")
        mine = groups[0]
    context = _green(driver, device, mine)
    stream = _check(driver, driver.cuGreenCtxStreamCreate(
        context, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
    return context, int(stream), mine.sm.smCount


def _green(driver, device, resource):
    """A green context of ``resource`` on ``device`` (a ``cuda.bindings`` handle)."""
    desc = _check(driver, driver.cuDevResourceGenerateDesc([resource], 1))
    return _check(driver, driver.cuGreenCtxCreate(
        desc, device, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))


def _check(driver, result):
    """A ``cuda.bindings.driver`` call's value (or values), or a RuntimeError naming its
    error."""
    error, *values = result
    if error != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver error {getattr(error, 'name', error)}")
    return values[0] if len(values) == 1 else values


def _torch_partition(num_sms: int, device_index: int):
    """torch's green context of ``num_sms`` SMs, its stream made the current stream (or, on
    torch versions whose green contexts have no stream, the context made current)."""
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
                         f"{device_index}: {_first_line(err)}") from None
    if hasattr(context, "Stream"):
        torch.cuda.set_stream(context.Stream())
    else:
        context.set_context()
    return context


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]


def mps_control() -> str | None:
    """The MPS control program: on PATH, else beside the driver's programs; None: absent."""
    return shutil.which(MPS_CONTROL) or shutil.which(MPS_CONTROL, path=_DRIVER_BIN)


def _pipe_directory() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", _DEFAULT_PIPE_DIRECTORY))


def mps_running() -> bool:
    """Whether an MPS control daemon listens (its control pipe exists)."""
    return (_pipe_directory() / "control").exists()


@contextlib.contextmanager
def mps_daemon(shared: Sequence[int]) -> Iterator[str]:
    """Make sure MPS runs while the block runs, when ranks share the GPUs ``shared``.

    Yields what was done: ``"not needed"``, ``"off"`` (``QSYNC_MPS=off``: the ranks take
    turns on the GPU), ``"already running"`` or ``"started"``; a daemon this started is
    stopped when the block ends, however it ends (``echo quit | nvidia-cuda-mps-control``,
    given up on after 10 s: a daemon left running harms nothing).

    Example: ``with mps_daemon([0]) as how: ...`` around a run of two ranks on GPU 0.

    Raises:
        QSyncError: GPUs are shared and MPS is neither running nor startable here.
    """
    if not shared:
        yield "not needed"
        return
    if os.environ.get(MPS_ENV) == "off":
        yield "off"
        return
    if mps_running():
        yield "already running"
        return
    control = mps_control()
    gpus = ", ".join(map(str, shared))
    if control is None:
        raise QSyncError(f"ranks share GPU {gpus}, which runs their processes at once only "
                         f"under NVIDIA MPS, and {MPS_CONTROL} is not on PATH (nor in "
                         f"{_DRIVER_BIN}): start MPS "
                         f"(as root), set {MPS_ENV}=off to let them take turns, or give each "
                         "rank a GPU of its own")
    # the daemon starts nvidia-cuda-mps-server from its own folder's neighbours
    environment = {**os.environ, "PATH": os.pathsep.join(
        [str(Path(control).parent), os.environ.get("PATH", "")])}
    log = Path(environment.setdefault("CUDA_MPS_LOG_DIRECTORY", _DEFAULT_LOG_DIRECTORY))
    log.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run([control, "-d"], capture_output=True, text=True, env=environment,
                              timeout=_WAIT_S)
        started = done.returncode == 0 and _wait_for(mps_running, _WAIT_S)
        reason = (done.stderr or done.stdout).strip().splitlines() or [f"exit {done.returncode}"]
    except subprocess.TimeoutExpired:
        started, reason = False, [f"{MPS_CONTROL} -d still running after {_WAIT_S:.0f} s"]
    if not started:
        _quit(control, environment)  # a daemon that started but does not answer
        raise QSyncError(f"could not start MPS for the ranks sharing GPU {gpus} ({reason[0]}; "
                         f"its log: {log / 'control.log'}); it needs root: start it yourself, "
                         f"set {MPS_ENV}=off to let them take turns, or give each rank a GPU "
                         "of its own")
    try:
        yield "started"
    finally:
        _quit(control, environment)


def _quit(control: str, environment: dict[str, str]) -> None:
    """Stop the MPS daemon, giving up after a while (a daemon left running harms nothing)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run([control], input="quit\n", capture_output=True, text=True,
                       env=environment, timeout=_WAIT_S)
    _wait_for(lambda: not mps_running(), _WAIT_S)


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
