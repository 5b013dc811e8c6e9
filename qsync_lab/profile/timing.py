"""Timing primitives of the profiler: the median wall time of a callable, a hold on a CUDA
stream, thread settings, and the run's metadata.

The timers (:mod:`qsync_lab.timers`: host-clock spans on the CPU, CUDA events resolved
after one synchronise on a GPU) time what the stream did between two events: the kernels,
and any wait for the host to launch them. To time the device alone, :func:`hold_stream`
first keeps the stream busy for longer than the host takes to issue the work (a spin
kernel): the work then queues behind it and runs back to back. :func:`median_time_us`
times one call per repeat with a timer (a CUDA repeat is synchronised once, after its end
event); warm-up calls are run first and discarded; the result is the median of
``repeats`` timed calls.
(:mod:`qsync_lab.profile.device` checks the device a profile runs on and names its rows.)

Example::

    >>> median_time_us(lambda: sum(range(100)), repeats=5, warmup=1) > 0
    True
    >>> sorted(run_metadata("cpu", threads=1))[:3]
    ['cuda_version', 'date', 'device']
    >>> with intra_op_threads(1):
    ...     torch.get_num_threads()
    1
    >>> with spawned_numba_threads(1):
    ...     os.environ["NUMBA_NUM_THREADS"]
    '1'
"""

import datetime
import functools
import importlib.metadata
import os
import platform
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from qsync_lab.errors import QSyncError
from qsync_lab.timers import CudaEventTimer, timer_for

__all__ = ["hold_stream", "intra_op_threads", "median_time_us", "run_metadata",
           "spawned_numba_threads"]

_NS_PER_US = 1e3
_SPIN_CYCLES = 1_000_000  # the spin kernel that measures the device's cycles per µs


@contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """Run the block with ``threads`` torch and Numba threads (the cores one DDP rank will
    have), then restore both. Numba's pool is capped at the size it started with.

    A profile with fewer threads than its process has cores must limit Numba too: Numba's
    parallel kernels (low-precision emulation) otherwise use every core, and on a busy
    machine their barriers wait on descheduled threads (and the ops measure far too slow).
    """
    import numba

    if threads < 1:
        raise QSyncError(f"threads must be a positive integer, got {threads}")
    torch_threads, numba_threads = torch.get_num_threads(), numba.get_num_threads()
    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        torch.set_num_threads(torch_threads)
        numba.set_num_threads(numba_threads)


@contextmanager
def spawned_numba_threads(threads: int) -> Iterator[None]:
    """Processes started in the block get a Numba pool of ``threads`` threads (the cores one
    DDP rank will have), then the environment is restored.

    A process sizes its pool from ``NUMBA_NUM_THREADS`` when it imports Numba, one thread
    per core by default: spawned ranks that share a machine would each start that many,
    and their parallel kernels (the compressors) would oversubscribe the cores.
    """
    if threads < 1:
        raise QSyncError(f"threads must be a positive integer, got {threads}")
    before = os.environ.get("NUMBA_NUM_THREADS")
    os.environ["NUMBA_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if before is None:
            del os.environ["NUMBA_NUM_THREADS"]
        else:
            os.environ["NUMBA_NUM_THREADS"] = before


def hold_stream(device: "torch.device | str", us: float) -> None:
    """Keep CUDA ``device``'s current stream busy for about ``us`` µs (a spin kernel,
    ``torch.cuda._sleep``), so that work issued meanwhile queues behind it: CUDA events
    around that work then time the device alone, not the host's launches. Nothing for
    ``us <= 0``."""
    if us > 0:
        device = torch.device(device)
        with torch.cuda.device(device):
            torch.cuda._sleep(int(us * _spin_cycles_per_us(device)))


@functools.lru_cache(maxsize=None)
def _spin_cycles_per_us(device: torch.device) -> float:
    """Clock cycles per µs of ``torch.cuda._sleep`` on ``device``, measured once."""
    timer = CudaEventTimer(device)
    with torch.cuda.device(device):
        torch.cuda._sleep(_SPIN_CYCLES)  # warm-up
        begin = timer.mark()
        torch.cuda._sleep(_SPIN_CYCLES)
        timer.add(None, begin, timer.mark())
    return _SPIN_CYCLES / (timer.totals_ns()[None] / _NS_PER_US)


def median_time_us(fn: Callable[[], object], *, repeats: int = 20, warmup: int = 3,
                   device: "torch.device | str" = "cpu") -> float:
    """Median duration of ``fn()`` in µs over ``repeats`` calls after ``warmup`` calls.

    Args:
        fn: the work to time (its result is discarded).
        repeats: timed calls (at least 1).
        warmup: untimed calls first.
        device: where the work runs; it picks the timer (:func:`timer_for`).
    """
    if repeats < 1 or warmup < 0:
        raise QSyncError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        timer = timer_for(device)
        begin = timer.mark()
        fn()
        timer.add(None, begin, timer.mark())
        samples.append(timer.totals_ns()[None] / _NS_PER_US)
    return float(statistics.median(samples))


def run_metadata(device: str, *, threads: int) -> dict[str, str]:
    """The ``# key: value`` lines a profile carries: device, software versions, threads, date.

    Args:
        device: the catalog device name the profile is for.
        threads: the intra-op threads the measurements ran with
            (``torch.get_num_threads()`` during the profile).
    """
    import numba

    cuda = torch.cuda.is_available()
    gpu = cuda and device != "cpu"  # a CPU profile on a GPU machine names the CPU
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name() if gpu else (platform.processor()
                                                                 or platform.machine()),
        "torch_version": torch.__version__,
        "cuda_version": str(torch.version.cuda) if cuda else "none",
        "numba_version": numba.__version__,
        "qsync_lab_version": _package_version("qsync-lab"),
        "threads": str(threads),
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
