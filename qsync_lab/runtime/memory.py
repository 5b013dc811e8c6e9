"""Peak tensor memory of a stretch of training, on the CPU or on CUDA.

On CUDA it is ``torch.cuda.max_memory_allocated`` since the window opened. On the CPU,
torch.profiler's memory events (+bytes per allocation, -bytes per free) summed in time
order: every tensor the window allocates is inside it, so the running sum is the live
tensor bytes and the peak is its maximum.

Example::

    >>> import torch
    >>> window = MemoryWindow(cuda=False)
    >>> x = torch.zeros(1024, 1024)   # 4 MiB
    >>> window.close() >= 4 * 2**20
    True
"""

import torch

__all__ = ["MemoryWindow", "peak_cpu_bytes"]


class MemoryWindow:
    """Measures the peak tensor memory from construction to :meth:`close`."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.peak_bytes: int | None = None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            self._profiler = None
        else:
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
                self.peak_bytes = peak_cpu_bytes(self._profiler)
                self._profiler = None
        return self.peak_bytes


def peak_cpu_bytes(prof: torch.profiler.profile) -> int:
    """Maximum running sum of a finished profiler's ``[memory]`` events, in time order."""
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return peak
