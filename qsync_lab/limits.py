"""Bounds on the files qsync_lab reads: size, nesting depth, counts, numbers.

A plan, cluster or profile may come from anyone; a broken or hostile one must fail in one
line, never exhaust memory or the stack. :func:`read_bounded_bytes` refuses a file over
:data:`MAX_FILE_BYTES` before reading it; :func:`loads_json` parses strict JSON (no
``NaN``/``Infinity``, at most :data:`MAX_DEPTH` levels); :func:`check_json_data` and
:func:`check_depth` check data that is already parsed.

Example::

    >>> loads_json('{"batch_size": 16}', "plan p.json")
    {'batch_size': 16}
    >>> try:
    ...     loads_json('{"batch_size": Infinity}', "plan p.json")
    ... except QSyncError as err:
    ...     print(err)
    plan p.json: Infinity is not a finite number; write a plain number
"""

import json
import math
import os
import stat
from collections.abc import Iterator, Mapping
from typing import Any

from qsync_lab.errors import QSyncError

__all__ = ["MAX_BATCH_SIZE", "MAX_DEPTH", "MAX_FILE_BYTES", "MAX_INT", "MAX_RANKS",
           "RANKS_PER_CORE", "check_depth", "check_json_data", "loads_json",
           "read_bounded_bytes", "too_deep"]

MAX_FILE_BYTES = 16 * 2**20  # a plan, cluster or profile file
MAX_DEPTH = 32  # nested tables and lists
MAX_RANKS = 4096  # ranks of a cluster (and device count of a group)
MAX_BATCH_SIZE = 2**20  # per-rank batch size
MAX_INT = 2**63 - 1  # what a JSON reader elsewhere can hold
#: local ranks (or profiling processes) a core may carry before ``qsync-lab run`` asks for
#: ``--oversubscribe`` and ``qsync-lab profile`` refuses
RANKS_PER_CORE = 2

_JSON_VALUES = (list, tuple, str, int, float, bool, type(None))  # besides tables


def read_bounded_bytes(path: "str | os.PathLike[str]", origin: str, *,
                       limit_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file ``path``, refused before reading when over the limit.

    OSErrors (a missing file, no permission) pass through for the caller to word.

    Example::

        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "big.json"
        >>> _ = path.write_text("[1]" * 10)
        >>> try:
        ...     read_bounded_bytes(path, "plan big.json", limit_bytes=16)
        ... except QSyncError as err:
        ...     print(err)
        plan big.json: the file has 30 bytes, over the limit of 16; check that this is the right file
    """
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise QSyncError(f"{origin}: not a regular file; give the path to a file")
    if info.st_size > limit_bytes:
        raise QSyncError(f"{origin}: the file has {info.st_size} bytes, over the limit of "
                         f"{limit_bytes}; check that this is the right file")
    with open(path, "rb") as handle:
        data = handle.read(limit_bytes + 1)  # it may have grown since the stat
    if len(data) > limit_bytes:
        raise QSyncError(f"{origin}: the file grew over the limit of {limit_bytes} bytes "
                         "while being read; check that nothing else writes it")
    return data


def loads_json(text: str, origin: str) -> Any:
    """Strict JSON: finite numbers, integers within 64 bits, at most :data:`MAX_DEPTH` levels.

    Raises:
        QSyncError: invalid JSON or one of the bounds, in one line naming ``origin``.
    """
    def refuse_constant(name: str) -> None:
        raise QSyncError(f"{origin}: {name} is not a finite number; write a plain number")

    try:
        value = json.loads(text, parse_constant=refuse_constant)
    except RecursionError:
        raise too_deep(origin) from None
    except QSyncError:
        raise
    except json.JSONDecodeError as err:
        raise QSyncError(f"cannot read {origin}: invalid JSON ({err.msg} at line "
                         f"{err.lineno} column {err.colno}); fix the syntax or write it again "
                         "with qsync_lab") from None
    except ValueError:  # an integer of more than 4300 digits
        raise QSyncError(f"{origin}: a number has too many digits; write numbers within 64 "
                         "bits") from None
    check_json_data(value, origin)
    return value


def check_json_data(value: Any, origin: str, *, max_items: int | None = None) -> None:
    """Raise unless ``value`` is JSON data within bounds: tables with text keys, lists,
    text, booleans, null, integers within 64 bits, finite floats, at most
    :data:`MAX_DEPTH` levels and (if given) ``max_items`` values in all.

    Example::

        >>> try:
        ...     check_json_data({"kwargs": {"width": float("nan")}}, "plan p.json")
        ... except QSyncError as err:
        ...     print(err)
        plan p.json: kwargs.width: nan is not a finite number; write a plain number
    """
    for count, (where, depth, item) in enumerate(_walk(value), start=1):
        _check_depth_at(where, depth, origin)
        if max_items is not None and count > max_items:
            raise QSyncError(f"{origin}: more than {max_items} values; keep it smaller")
        if isinstance(item, Mapping):
            key = next((k for k in item if not isinstance(k, str)), None)
            if key is not None:
                raise QSyncError(f"{_at(origin, where)}: key {key!r} is not text; name "
                                 "entries with text")
        elif isinstance(item, float) and not math.isfinite(item):
            raise QSyncError(f"{_at(origin, where)}: {item} is not a finite number; write a "
                             "plain number")
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) > MAX_INT:
            raise QSyncError(f"{_at(origin, where)}: an integer of {item.bit_length()} bits "
                             "is beyond the 64-bit range; write a smaller number")
        elif not isinstance(item, _JSON_VALUES):
            raise QSyncError(f"{_at(origin, where)}: a {type(item).__name__} is not JSON "
                             "data; use numbers, text, lists and tables")


def check_depth(value: Any, origin: str) -> None:
    """Raise unless ``value``'s tables and lists nest at most :data:`MAX_DEPTH` levels."""
    for where, depth, _ in _walk(value):
        _check_depth_at(where, depth, origin)


def too_deep(origin: str) -> QSyncError:
    """The error for a document nested deeper than :data:`MAX_DEPTH` levels."""
    return QSyncError(f"{origin}: nested deeper than {MAX_DEPTH} levels; a qsync_lab file "
                      "never is (is it the right file?)")


def _check_depth_at(where: str, depth: int, origin: str) -> None:
    if depth > MAX_DEPTH:
        raise too_deep(_at(origin, where))


def _walk(value: Any) -> Iterator[tuple[str, int, Any]]:
    """``(dotted path, depth, item)`` of ``value`` and everything in it, without recursion
    (a deep document must not overflow the stack); a container deeper than
    :data:`MAX_DEPTH` is reported but not entered."""
    stack = [("", 0, value)]
    while stack:
        where, depth, item = stack.pop()
        yield where, depth, item
        if depth > MAX_DEPTH:
            continue
        if isinstance(item, Mapping):
            children = [(f"{where}.{_key(k)}" if where else _key(k), v)
                        for k, v in item.items()]
        elif isinstance(item, list | tuple):
            children = [(f"{where}[{i}]", v) for i, v in enumerate(item)]
        else:
            continue
        stack.extend((path, depth + 1, child) for path, child in reversed(children))


def _key(key: Any) -> str:
    """A key as a path shows it: as it is, or its repr if that is needed to keep one line."""
    text = str(key)
    return text if text.isprintable() and not any(c.isspace() for c in text) else repr(text)


def _at(origin: str, where: str, limit: int = 80) -> str:
    """``origin: where``, a long path cut to its start."""
    where = where if len(where) <= limit else where[:limit - 3] + "..."
    return f"{origin}: {where}" if where else origin
