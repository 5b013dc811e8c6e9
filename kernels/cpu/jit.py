"""``njit`` with a disk cache whose key also covers the sources the kernels inline.

Numba invalidates a disk-cached kernel when the file that defines it changes, not when a
function it calls from another file does. The kernels inline ``floatfmt``'s and ``rng``'s
functions and the helpers of this package's other modules, so a digest of all those sources
is part of every cache key: editing any of them compiles the kernels again.
"""

import hashlib
from pathlib import Path

import numpy as np
from numba import njit

from .. import floatfmt, rng


def _sources_digest(*paths):
    """sha256 of the files' contents (None when one cannot be read)."""
    h = hashlib.sha256()
    try:
        for path in paths:
            with open(path, "rb") as f:
                h.update(f.read())
    except (OSError, TypeError):
        return None
    return h.hexdigest()


_DEPENDENCIES = (floatfmt.__file__, rng.__file__, *sorted(Path(__file__).parent.glob("*.py")))
_DEPS_DIGEST = _sources_digest(*_DEPENDENCIES)


def _jit(**options):
    """``njit(cache=True, **options)``, keyed also on ``_DEPS_DIGEST``; plain ``njit`` where
    Numba has nowhere to write a cache (read-only install and home) or its cache internals
    are not the ones known here (then compiling per process is the safe choice)."""

    def decorate(fn):
        if _DEPS_DIGEST is None:
            return njit(**options)(fn)
        try:
            disp = njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available for file ..."
            return njit(**options)(fn)
        if getattr(getattr(disp, "_cache", None), "_index_key", None) is None:
            return njit(**options)(fn)
        disp._cache._index_key = lambda sig, codegen: (
            sig, codegen.magic_tuple(), _function_digest(fn), _DEPS_DIGEST)
        return disp

    return decorate


_PLAIN = (type(None), bool, int, float, str, np.generic, np.dtype)


def _function_digest(fn) -> str:
    """sha256 of ``fn``'s code and, recursively, of what its closure holds.

    It replaces the code-and-closure part of Numba's cache key, which pickles the closure:
    a jitted function pickles with an id drawn anew in every process, so a kernel that
    closes over another (a ``*_for(fmt)`` factory's) missed the cache in every process
    and was compiled again (seconds per process, and one more cache entry each time).
    Plain values (format tuples, flags) go in by ``repr``; anything else by Numba's own
    pickle (a miss at worst, never a wrong hit).
    """
    h = hashlib.sha256(_code_digest(fn.__code__).encode())
    for cell in fn.__closure__ or ():
        h.update(_value_digest(cell.cell_contents).encode())
    return h.hexdigest()


def _code_digest(code) -> str:
    """sha256 of a code object's bytecode, names and constants (nested code by digest:
    its ``repr`` holds an address)."""
    consts = [_code_digest(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts]
    return hashlib.sha256(repr((code.co_code, code.co_names, consts)).encode()).hexdigest()


def _value_digest(value) -> str:
    inner = getattr(value, "py_func", None)
    if inner is not None:
        return "fn:" + _function_digest(inner)
    if isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value) or \
            isinstance(value, _PLAIN):
        return "v:" + repr(value)
    from numba.core.serialize import dumps

    return "p:" + hashlib.sha256(dumps(value)).hexdigest()
