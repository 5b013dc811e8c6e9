"""Timing primitives of the profiler: timers chosen by device, the median wall time of a
callable, and the run's metadata.

A timer times spans of work between marks and sums them per key:

* :class:`HostTimer` (CPU, synchronous work): a mark is ``time.perf_counter_ns()``, and a
  span is added as soon as it ends;
* :class:`CudaEventTimer` (CUDA, asynchronous work): a mark is a CUDA event recorded on the
  device's current stream (``torch.cuda.Event(enable_timing=True)``), and nothing is read
  until :meth:`CudaEventTimer.totals_ns`, which synchronises the device once and resolves
  every span with ``elapsed_time``: timing never stalls the stream in between.

:func:`timer_for` picks one by the device the work runs on. A CUDA span times what the
stream did between its events: the kernels, and any wait for the host to launch them. To
time the device alone, :func:`hold_stream` first keeps the stream busy for longer than
the host takes to issue the work (a spin kernel): the work then queues behind it and
runs back to back. :func:`median_time_us` times
one call per repeat with it (a CUDA repeat is synchronised once, after its end event);
warm-up calls are run first and discarded; the result is the median of ``repeats`` timed
calls.
(:mod:`qsync_lab.profile.device` checks the device a profile runs on and names its rows.)

Example::

    >>> timer = timer_for("cpu")
    >>> begin = timer.mark(); _ = sum(range(100)); timer.add("sum", begin, timer.mark())
    >>> list(timer.totals_ns()), timer.totals_ns()["sum"] > 0
    (['sum'], True)
    >>> type(timer_for("cuda:0")).__name__
    'CudaEventTimer'
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
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from qsync_lab.errors import QSyncError

__all__ = ["CudaEventTimer", "HostTimer", "hold_stream", "intra_op_threads", "median_time_us",
           "run_metadata", "spawned_numba_threads", "timer_for"]

_NS_PER_US = 1e3
_NS_PER_MS = 1e6
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


class HostTimer:
    """Spans read off the host clock as they end (synchronous work: the CPU)."""

    def __init__(self) -> None:
        self._ns: dict = {}

    def mark(self) -> int:
        """Now, in ns (``time.perf_counter_ns``)."""
        return time.perf_counter_ns()

    def add(self, key, begin: int, end: int) -> None:
        """Add the span from mark ``begin`` to mark ``end`` to ``key``'s total."""
        self._ns[key] = self._ns.get(key, 0) + (end - begin)

    def totals_ns(self) -> dict:
        """Each key's summed spans, ns."""
        return dict(self._ns)


class CudaEventTimer:
    """Spans between CUDA events on ``device``'s current stream, all resolved at once by
    :meth:`totals_ns` after one synchronise (asynchronous work: a GPU)."""

    def __init__(self, device: "torch.device | str") -> None:
        self.device = torch.device(device)
        self._spans: list = []

    def mark(self):
        """A timing event recorded now on the device's current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def add(self, key, begin, end) -> None:
        """Keep the span from event ``begin`` to event ``end`` for ``key`` (read later)."""
        self._spans.append((key, begin, end))

    def totals_ns(self) -> dict:
        """Synchronise the device, then each key's summed spans, ns."""
        torch.cuda.synchronize(self.device)
        totals: dict = {}
        for key, begin, end in self._spans:
            totals[key] = totals.get(key, 0.0) + begin.elapsed_time(end) * _NS_PER_MS
        return totals


def timer_for(device: "torch.device | str") -> "HostTimer | CudaEventTimer":
    """A :class:`CudaEventTimer` for a CUDA device, else a :class:`HostTimer`."""
    device = torch.device(device)
    return CudaEventTimer(device) if device.type == "cuda" else HostTimer()


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
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name() if cuda else (platform.processor()
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
