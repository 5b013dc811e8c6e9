"""A plan's fields: :class:`RankPlan`, the checks of single values, and the read-only form
of the JSON data a plan carries.

Example::

    >>> RankPlan(1, "T4", 16)
    RankPlan(rank=1, device='T4', batch_size=16)
    >>> thawed(frozen_data({"a": [1, {"b": 2}]}))
    {'a': [1, {'b': 2}]}
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from qsync_lab.errors import QSyncError
from qsync_lab.limits import MAX_BATCH_SIZE, MAX_RANKS, check_json_data
from qsync_lab.tomlfile import is_text, show

__all__ = ["MAX_MODEL_KWARGS", "MAX_TEXT_CHARS", "RankPlan", "check_model", "check_text",
           "frozen", "frozen_data", "is_any", "thawed"]

MAX_TEXT_CHARS = 256  # a fingerprint, strategy, device kind or model name
MAX_MODEL_KWARGS = 1000  # values in a model's keyword arguments, nested ones included
#: a zoo model's name, or a function of the user's that builds one: ``package.module:function``
_MODEL_NAME = re.compile(r"[A-Za-z_]\w*(?:(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*)?", re.ASCII)


@dataclass(frozen=True)
class RankPlan:
    """What one rank runs: its device kind and batch size."""

    rank: int
    device: str
    batch_size: int

    def __post_init__(self) -> None:
        for name, least, most in (("rank", 0, MAX_RANKS - 1), ("batch_size", 1, MAX_BATCH_SIZE)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
                raise QSyncError(f"{name}: expected an integer in {least}..{most}, got "
                                 f"{show(value)}")
        check_text("device", self.device)


def check_model(name: Any, kwargs: Any) -> None:
    """The model's name has the form of a zoo name (an identifier), of a ``module:function``
    spec or is empty: never a path. Its arguments are plain JSON data of bounded size.

    Which zoo models exist, and which arguments they take, is checked where the model is
    built (:func:`qsync_lab.runtime.launch.check_run`), so that loading a plan needs no torch.

    Example::

        >>> check_model("mypkg.models:build", {"width": 8})
        >>> check_model("../net.py", {})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        qsync_lab.errors.QSyncError: model '../net.py' is neither a zoo model name nor ...
    """
    if not isinstance(name, str) or len(name) > MAX_TEXT_CHARS:
        raise QSyncError(f"model name must be text of at most {MAX_TEXT_CHARS} characters, "
                         f"got {show(name)}")
    if name and not _MODEL_NAME.fullmatch(name):
        raise QSyncError(f"model {show(name)} is neither a zoo model name nor a "
                         "module:function spec such as mypkg.models:build (letters, digits, _ "
                         "and dots only); re-plan with `qsync-lab plan --model`")
    if not isinstance(kwargs, Mapping):
        raise QSyncError(f"model kwargs must be a table, got {show(kwargs)}")
    check_json_data(thawed(kwargs), "model kwargs", max_items=MAX_MODEL_KWARGS)


def check_text(what: str, value: Any) -> None:
    """``value`` is non-empty text of at most :data:`MAX_TEXT_CHARS` characters."""
    if not is_text(value) or len(value) > MAX_TEXT_CHARS:
        raise QSyncError(f"{what} must be non-empty text of at most {MAX_TEXT_CHARS} "
                         f"characters, got {show(value)}")


def is_any(value: Any) -> bool:
    """Any value (for an entry that is only required here and checked where it is used)."""
    return True


def frozen(mapping: Mapping[str, Mapping]) -> Mapping[str, Mapping]:
    """A mapping of mappings made read-only, one level deep (their values stay as they are)."""
    return MappingProxyType({k: MappingProxyType(dict(v)) for k, v in mapping.items()})


def frozen_data(value: Any) -> Any:
    """JSON-like data made read-only (mappings as mapping proxies, lists as tuples)."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): frozen_data(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(frozen_data(v) for v in value)
    return value


def thawed(value: Any) -> Any:
    """The inverse of :func:`frozen_data`: plain dicts and lists for JSON."""
    if isinstance(value, Mapping):
        return {k: thawed(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thawed(v) for v in value]
    return value
