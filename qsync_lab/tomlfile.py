"""Reading TOML files with one-line, located errors.

A :class:`TomlTable` remembers the file and dotted key it came from, so every problem is
reported as ``<file>: <dotted key>: <what is wrong>``.

Example::

    >>> from qsync_lab.resources import data_file
    >>> links = read_toml(data_file("links.toml"))
    >>> links.table("link").table("nvlink2").number("bandwidth_GBps")
    150.0
"""

import math
import os
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path

from qsync_lab.errors import QSyncError
from qsync_lab.limits import MAX_INT, check_depth, read_bounded_bytes, too_deep

REQUIRED = object()  # marks a TOML key without a default
MAX_NUMBER = 1e12  # a larger number in a device, link or cluster file is a wrong unit


@dataclass(frozen=True)
class TomlTable:
    """A table read from a TOML file that knows where it came from, for one-line errors.

    The typed getters raise :class:`QSyncError` naming the file and the dotted key, e.g.
    ``devices.toml: device.T4.memory_gib: expected a positive number, got 'x'``.

    Attributes:
        data: the parsed table.
        file: the file it was read from, as shown in messages.
        key: dotted key of this table inside the file ("" for the whole document).
    """

    data: Mapping[str, object]
    file: str
    key: str = ""

    def where(self, name: str | None = None) -> str:
        """``"<file>: <dotted key>"`` of this table, or of its entry ``name``."""
        key = self._child_key(name) if name is not None else self.key
        return f"{self.file}: {key}" if key else self.file

    def error(self, message: str, name: str | None = None) -> QSyncError:
        """A one-line QSyncError about this table (or its entry ``name``)."""
        return QSyncError(" ".join(f"{self.where(name)}: {message}".split()))

    def value(
        self,
        name: str,
        expected: str,
        ok: Callable[[object], bool],
        default: object = REQUIRED,
    ) -> object:
        """Entry ``name`` if ``ok(entry)``; ``default`` if absent (required when not given)."""
        if name not in self.data:
            if default is REQUIRED:
                raise self.error(f"missing; expected {expected}", name)
            return default
        found = self.data[name]
        if not ok(found):
            raise self.error(f"expected {expected}, got {show(found)}", name)
        return found

    def string(self, name: str, default: object = REQUIRED) -> str:
        """A non-empty string entry."""
        return self.value(name, "a non-empty string", is_text, default)

    def number(self, name: str, *, allow_zero: bool = False,
               maximum: float = MAX_NUMBER) -> float:
        """A finite positive (or, with ``allow_zero``, non-negative) number entry, at most
        ``maximum``."""
        if allow_zero:
            found = self.value(name, "a number >= 0", lambda v: is_number(v) and v >= 0)
        else:
            found = self.value(name, "a positive number", lambda v: is_number(v) and v > 0)
        return float(self._at_most(name, found, maximum))

    def positive_int(self, name: str, default: object = REQUIRED, *,
                     maximum: int = MAX_INT) -> int:
        """A positive integer entry, at most ``maximum`` (booleans and floats are refused).

        Example::

            >>> try:
            ...     TomlTable({"count": 10**9}, "my.toml").positive_int("count", maximum=4096)
            ... except QSyncError as err:
            ...     print(err)
            my.toml: count: 1000000000 is over the limit of 4096; use a smaller number
        """
        found = self.value(name, "a positive integer", is_positive_int, default)
        return found if found is default else self._at_most(name, found, maximum)

    def table(self, name: str, default: Mapping[str, object] | object = REQUIRED) -> "TomlTable":
        """The sub-table ``name`` (``default``, e.g. ``{}``, when absent)."""
        data = self.value(name, "a table", lambda v: isinstance(v, Mapping), default)
        return TomlTable(data, self.file, self._child_key(name))

    def tables(self, name: str) -> list["TomlTable"]:
        """The non-empty array of tables ``name``, each knowing its ``name[i]`` key."""
        items = self.value(
            name,
            "a non-empty array of tables",
            lambda v: isinstance(v, list) and bool(v) and all(isinstance(t, Mapping) for t in v),
        )
        return [
            TomlTable(item, self.file, self._child_key(name, index))
            for index, item in enumerate(items)
        ]

    def subtables(self) -> dict[str, "TomlTable"]:
        """Every entry of this table, each of which must itself be a table."""
        return {name: self.table(name) for name in self.data}

    def check_keys(self, allowed: Iterable[str]) -> None:
        """Raise QSyncError naming the first key of this table that is not in ``allowed``."""
        allowed = set(allowed)
        unknown = sorted(set(self.data) - allowed)
        if unknown:
            expected = ", ".join(sorted(allowed))
            raise self.error(f"unknown key; expected one of: {expected}", unknown[0])

    def _at_most(self, name: str, found: float, maximum: float) -> float:
        if found > maximum:
            raise self.error(f"{show(found)} is over the limit of {maximum:g}; use a smaller "
                             "number", name)
        return found

    def _child_key(self, name: str, index: int | None = None) -> str:
        key = f"{self.key}.{name}" if self.key else str(name)
        return key if index is None else f"{key}[{index}]"


def read_toml(source: "Traversable | str | os.PathLike[str]") -> TomlTable:
    """Parse a TOML file into a :class:`TomlTable`, turning every failure into a QSyncError.

    Example::

        >>> from qsync_lab.resources import data_file
        >>> read_toml(data_file("links.toml")).data["schema_version"]
        1
    """
    path = Path(source) if isinstance(source, str | os.PathLike) else source
    document = TomlTable({}, str(path))
    try:
        data = (read_bounded_bytes(path, document.file) if isinstance(path, Path)
                else path.read_bytes())  # a shipped file
        parsed = tomllib.loads(data.decode("utf-8"))
    except RecursionError:
        raise too_deep(document.file) from None
    except QSyncError:  # over the size limit
        raise
    except FileNotFoundError:
        raise document.error("no such file; check the path") from None
    except OSError as err:
        raise document.error(f"cannot read: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise document.error("invalid TOML: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as err:
        raise document.error(f"invalid TOML: {err}") from None
    except ValueError:  # an integer of more than 4300 digits
        raise document.error("a number has too many digits; write numbers within 64 bits") \
            from None
    check_depth(parsed, document.file)
    return TomlTable(parsed, document.file)



def is_text(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())



def is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def is_number(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool)


def show(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
