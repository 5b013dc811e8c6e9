"""How the kernels walk a flat array: parallel chunks, row segments and period vectors.

Every kernel works on a flat array whose element ``i`` belongs to channel
``(i // inner) % nch`` (per tensor: ``inner = n``, ``nch = 1``). Two loop shapes:

* long rows (per tensor, or ``inner >= VEC_INNER``): the array is split into a few contiguous
  chunks per thread; a chunk walks the row segments it covers, each with one scale;
* short rows (per channel along the last axis or axes, ``inner < VEC_INNER``): the scale is
  periodic in ``i`` with period ``P = nch * inner``, so a *period vector* (the scale of every
  position of one period, tiled to at least ``VEC_MIN`` elements; just ``scales`` when
  ``inner == 1``) is read beside the data, and each chunk walks whole periods.

Either way the innermost loop runs over array *slices* from index 0, with a scalar scale or a
slice of the period vector (``_at``): Numba's negative-index wrap-around then folds away and
LLVM vectorises the loop with contiguous loads and stores. (With ``for j in range(i, stop)``
over the full arrays it cannot prove ``j >= 0``: every load becomes a gather and every
int8 store a ``vpextrb`` scatter, and the loop runs far below memory bandwidth.)
"""

import numba
import numpy as np
from numba import njit
from numba.core import types
from numba.extending import overload

_MIN_CHUNK = 1 << 15
VEC_INNER = 256  # rows shorter than this use a period vector of scales
VEC_MIN = 1024  # a period vector is tiled to at least this many elements
VEC_PERIOD_MAX = 1 << 20  # largest period materialised (when inner > 1)
_SUM_BLOCK = 4096  # floats of a sum kept in L1 while every row is added to them


def _at(v, t):
    """``v[t]`` for an array (period vector), ``v`` itself for a scalar scale."""
    return v[t] if isinstance(v, np.ndarray) else v


@overload(_at)
def _at_overload(v, t):
    if isinstance(v, types.Array):
        return lambda v, t: v[t]
    return lambda v, t: v


def _part(v, a, b):
    """``v[a:b]`` for an array (period vector), ``v`` itself for a scalar scale."""
    return v[a:b] if isinstance(v, np.ndarray) else v


@overload(_part)
def _part_overload(v, a, b):
    if isinstance(v, types.Array):
        return lambda v, a, b: v[a:b]
    return lambda v, a, b: v


def _nchunks(n):
    """Chunks for n elements: a few per thread, none under ``_MIN_CHUNK`` elements.

    Computed here, not in the kernels: ``numba.get_num_threads()`` inside a kernel goes
    through a ctypes pointer, which would keep Numba from caching the kernel on disk.
    """
    return max(1, min(n // _MIN_CHUNK, 4 * numba.get_num_threads()))


@njit
def _bounds(n, nchunks, k):
    return (k * n) // nchunks, ((k + 1) * n) // nchunks


@njit
def _no_wrap(i, stop):
    """``stop``, or the next multiple of 2**32 after ``i`` when that comes first."""
    return min(stop, ((i >> 32) + 1) << 32)


@njit
def _segment(i, end, inner, nch):
    """Return (channel, stop) of the row segment that starts at flat index i."""
    row = i // inner
    return row % nch, _no_wrap(i, min(end, (row + 1) * inner))


@njit
def _period_stop(i, end, period):
    """Return (position in the period vector, stop) of the run that starts at flat index i."""
    p = i % period
    return p, _no_wrap(i, min(end, i + period - p))


_NOVEC = np.zeros(0, dtype=np.float32)


def _period_vector(values, inner, nch):
    """The period vector of per-channel ``values`` (float32), or None for long rows.

    Position ``p`` of the result holds ``values[(p // inner) % nch]``; its length is a multiple
    of ``nch * inner``, at least ``VEC_MIN``.
    """
    period = inner * nch
    if nch == 1 or inner >= VEC_INNER or (inner > 1 and period > VEC_PERIOD_MAX):
        return None
    v = np.ascontiguousarray(values, dtype=np.float32)
    if inner > 1:
        v = np.repeat(v, inner)
    if period < VEC_MIN:
        v = np.tile(v, -(-VEC_MIN // period))
    return v
