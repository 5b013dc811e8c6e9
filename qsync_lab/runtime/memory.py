"""Peak tensor memory of a stretch of training, on the CPU or on CUDA.

On CUDA it is ``torch.cuda.max_memory_allocated`` since the window opened. On the CPU it
comes from torch.profiler's memory events over the window. The profiler sees only the
allocations and frees of the thread it runs on, and a tensor allocated there but freed on
another thread (gloo's worker sometimes drops DDP's flattened broadcast buffer) would
stay live forever in a running sum of the events. So while the window is open we also
turn on c10's CPU memory accounting (``FLAGS_caffe2_report_cpu_memory_usage``),
which counts the frees of every thread: each event then carries the process-wide live
total, and the peak is its maximum over the window, less the total the window began with.
Where a torch build does not export that flag, the peak falls back to the running sum of
the events.

A run's peak is checked against the memory model in a process of its own, as under
``qsync-lab run``, where the window is the first. A later window in a long process once
read 1.1 MiB low (of 130 MiB, in CI's test process): the accounting is off between
windows, so c10's totals need not stay exact across them.

Example::

    >>> import torch
    >>> window = MemoryWindow(cuda=False)
    >>> x = torch.zeros(1024, 1024)   # 4 MiB
    >>> window.close() >= 4 * 2**20
    True
"""

import ctypes
import pathlib

import torch

__all__ = ["MemoryWindow", "peak_cpu_bytes"]

_ACCOUNTING_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


def _accounting_flag() -> ctypes.c_bool | None:
    """c10's all-thread CPU memory accounting switch, or None if this build hides it."""
    for library in sorted((pathlib.Path(torch.__file__).parent / "lib").glob("*c10.*")):
        try:
            return ctypes.c_bool.in_dll(ctypes.CDLL(str(library)), _ACCOUNTING_FLAG)
        except (OSError, ValueError):
            continue
    return None


class MemoryWindow:
    """Measures the peak tensor memory from construction to :meth:`close`."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.peak_bytes: int | None = None
        self._profiler = None
        self._flag = None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        self._flag = _accounting_flag()
        if self._flag is not None:
            self._flag_before = self._flag.value
            self._flag.value = True
        self._profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()

    @property
    def is_open(self) -> bool:
        return self.peak_bytes is None

    def close(self) -> int:
        """End the window (once; later calls return the same peak) and return its peak."""
        if self.peak_bytes is None:
            if self.cuda:
                self.peak_bytes = int(torch.cuda.max_memory_allocated())
            else:
                self._profiler.__exit__(None, None, None)
                if self._flag is not None:
                    self._flag.value = self._flag_before
                self.peak_bytes = peak_cpu_bytes(self._profiler,
                                                 all_threads=self._flag is not None)
                self._profiler = None
        return self.peak_bytes


def peak_cpu_bytes(prof: torch.profiler.profile, all_threads: bool = False) -> int:
    """Peak live tensor bytes of a finished profiler's allocation events.

    ``all_threads``: the events' process-wide live totals are trusted (c10's accounting
    was on), so frees on other threads count; otherwise the running sum of the events.
    Frees of blocks allocated before the window (an earlier window's tensors collected
    now) are not the window's memory: they are left out of both.
    """
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0].name == "Allocation":
            fields = event.typed[1]
            if fields.device.type == "cpu":
                events.append((event.start_time_ns, fields.alloc_size, fields.total_allocated,
                               fields.ptr))
    events.sort()
    if not events:
        return 0
    _, first_bytes, first_total, _ = events[0]
    window_blocks: set[int] = set()
    earlier_freed = live = peak = 0
    for _, nbytes, total, ptr in events:
        if nbytes > 0:
            window_blocks.add(ptr)
        elif ptr in window_blocks:
            window_blocks.discard(ptr)
        else:
            earlier_freed -= nbytes
            continue
        live += nbytes
        peak = max(peak, total + earlier_freed - (first_total - first_bytes)
                   if all_threads else live)
    return max(0, peak)
