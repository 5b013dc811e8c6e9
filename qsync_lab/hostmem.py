"""Keep freed host memory in the process, so steady training steps take no page faults.

glibc's malloc hands large freed blocks back to the kernel (``munmap`` above its mmap
threshold, heap trimming above its trim threshold), so every CPU training step touches
fresh pages again, and its page faults take a noticeable share of the step time. In a VM
whose freed pages go back to the host (free page reporting), what a fault costs also
changes with the host's state, so allocation-heavy (element-wise) op timings taken minutes
apart disagree. :func:`keep_freed_memory` sets ``mallopt`` so that no block is mmapped and
the heap is never trimmed: a process reuses its own freed memory. The profiler and the
training ranks call it, and both then see the same steady state.

The price is that the process's resident memory stays at its peak (tensor memory, which
the simulator predicts, is unchanged). Elsewhere than glibc it does nothing.

Example::

    >>> keep_freed_memory()  # glibc
    True
"""

import ctypes
import ctypes.util
import functools

__all__ = ["keep_freed_memory"]

# glibc's mallopt parameters and the values set: no block from mmap (each would be
# unmapped when freed), never trim the heap, grow it 64 MiB at a time
_SETTINGS = ((-4, 0), (-1, (1 << 31) - 1), (-2, 64 << 20))  # M_MMAP_MAX, M_TRIM_THRESHOLD, M_TOP_PAD


@functools.cache
def keep_freed_memory() -> bool:
    """Make this process keep the memory it frees (see the module docstring); True when
    glibc took the settings, False where there is no glibc ``mallopt``."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    return all([bool(mallopt(param, value)) for param, value in _SETTINGS])
