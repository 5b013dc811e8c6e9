"""What a gradient compressor does, and which parameters it applies to.

A :class:`CompressionSpec` names a method (:data:`~qsync_lab.compress.methods.METHODS`) and its
settings; ``"global_qsgd:8"``, ``"cgx:4"``, ``"aps:fp8_e4m3"`` or ``"fp16"`` are its short
forms. :class:`CompressionSettings` maps parameter FQNs to specs the way torchao's
``FqnToConfig`` maps modules to configs: keys are an exact FQN, a regular expression prefixed
``re:`` or ``_default``, and a value of None leaves a parameter uncompressed (plain fp32
allreduce). Tensors with fewer than ``min_numel`` elements, and 1-D tensors (biases, norm
weights) unless ``compress_1d``, are never compressed: their error would cost more than their
bytes save. :func:`bucket_groups` splits a DDP bucket by spec, for the hook and the simulator
alike.

Example::

    >>> settings = CompressionSettings.parse({"_default": "global_qsgd:8", "re:.*bias": None})
    >>> settings.spec_for("fc1.weight", numel=4096, ndim=2).method
    'global_qsgd'
    >>> settings.spec_for("fc1.bias", numel=4096, ndim=1) is None
    True
    >>> CompressionSpec.parse("cgx:4").unbiased, CompressionSpec.parse("aps").unbiased
    (True, False)
"""

import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from qsync_lab.compress.methods import MAX_BITS, METHODS
from qsync_lab.errors import QSyncError
from qsync_lab.tomlfile import show

__all__ = ["CompressionSettings", "CompressionSpec", "Group", "bucket_groups"]

_DITHERING = ("standard", "exponential")
_ROUNDING = ("stochastic", "nearest")
_APS_FORMATS = ("fp8_e5m2", "fp8_e4m3")
MAX_GROUP_SIZE = 2**24
MAX_MIN_NUMEL = 2**40
_DEFAULT_KEY = "_default"
_REGEX_PREFIX = "re:"


@dataclass(frozen=True)
class CompressionSpec:
    """One compressor's settings.

    Attributes:
        method: one of :data:`~qsync_lab.compress.methods.METHODS`.
        bits: ``global_qsgd``: bits of the integer codes on the wire (8, 16 or 32; each
            rank gets ``(2**(bits-1) - 1) // world`` levels, so the sum cannot overflow);
            ``cgx``: bits per value (1..8); ``qsgd``: ``2**(bits-1) - 1`` levels (2..8).
        dithering: ``global_qsgd``'s levels: ``standard`` (uniform) or ``exponential``.
        format: ``aps``'s code format, ``fp8_e5m2`` or ``fp8_e4m3``.
        group_size: ``cgx``'s elements per max-min group.
        rounding: ``cgx``'s rounding: ``stochastic`` (unbiased) or ``nearest`` (biased).
        error_feedback: add each parameter's last compression error to its next gradient.
        min_numel: tensors with fewer elements are sent uncompressed.
        compress_1d: compress 1-D tensors too (biases, norm weights).
    """

    method: str
    bits: int = 8
    dithering: str = "standard"
    format: str = "fp8_e5m2"
    group_size: int = 1024
    rounding: str = "stochastic"
    error_feedback: bool = False
    min_numel: int = 1024
    compress_1d: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise QSyncError(f"unknown compression method {show(self.method)}; choose one of: "
                             f"{', '.join(METHODS)}")
        for name, ok, expected in (
                ("bits", self._bits_ok(), METHODS[self.method].bits_text),
                ("dithering", self.dithering in _DITHERING, " or ".join(_DITHERING)),
                ("format", self.format in _APS_FORMATS, " or ".join(_APS_FORMATS)),
                ("group_size", _positive_int(self.group_size, MAX_GROUP_SIZE),
                 f"an integer in 1..{MAX_GROUP_SIZE}"),
                ("rounding", self.rounding in _ROUNDING, " or ".join(_ROUNDING)),
                ("error_feedback", isinstance(self.error_feedback, bool), "true or false"),
                ("min_numel", _positive_int(self.min_numel, MAX_MIN_NUMEL)
                 or self.min_numel == 0, f"an integer in 0..{MAX_MIN_NUMEL}"),
                ("compress_1d", isinstance(self.compress_1d, bool), "true or false")):
            if not ok:
                raise QSyncError(f"compression {self.method}: {name} must be {expected}, got "
                                 f"{show(getattr(self, name))}")

    def _bits_ok(self) -> bool:
        allowed = METHODS[self.method].bits
        return _positive_int(self.bits, MAX_BITS) and (allowed is None or self.bits in allowed)

    @property
    def unbiased(self) -> bool:
        """Whether the compressed mean equals the true mean in expectation."""
        return METHODS[self.method].unbiased(self)

    @property
    def key(self) -> str:
        """A canonical text of the spec (equal specs, equal keys)."""
        return ",".join(f"{k}={v}" for k, v in asdict(self).items())

    def applies_to(self, numel: int, ndim: int) -> bool:
        """Whether a tensor of ``numel`` elements and ``ndim`` dimensions is compressed."""
        return numel >= self.min_numel and (ndim > 1 or self.compress_1d)

    def to_dict(self) -> dict[str, Any]:
        """The settings that differ from the defaults, with the method (``parse`` reads it)."""
        default = CompressionSpec(self.method)
        return {"method": self.method, **{f.name: getattr(self, f.name) for f in fields(self)
                                          if getattr(self, f.name) != getattr(default, f.name)}}

    def __str__(self) -> str:
        """The short form, then the other settings that differ from the defaults.

        Example::

            >>> str(CompressionSpec("cgx", bits=4, error_feedback=True))
            'cgx:4,error_feedback=true'
        """
        field = METHODS[self.method].short
        short = f":{getattr(self, field)}" if field else ""
        extra = {k: v for k, v in self.to_dict().items() if k not in ("method", "bits", "format")}
        return self.method + short + "".join(
            f",{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in extra.items())

    @property
    def cost_label(self) -> str:
        """The text of the settings that change the time per element (profiles key their
        measurements by it): :meth:`__str__` without ``min_numel`` and ``compress_1d``."""
        default = CompressionSpec(self.method)
        return str(replace(self, min_numel=default.min_numel, compress_1d=default.compress_1d))

    @classmethod
    def parse(cls, spec: "str | Mapping[str, Any] | CompressionSpec") -> "CompressionSpec":
        """A spec from its text (``method[:bits]`` or ``aps[:format]``, then optional
        ``,field=value`` settings: ``cgx:4,error_feedback=true,group_size=512``), a mapping
        of its fields, or a spec."""
        if isinstance(spec, CompressionSpec):
            return spec
        if isinstance(spec, Mapping):
            unknown = set(spec) - {f.name for f in fields(cls)}
            if unknown or "method" not in spec:
                raise QSyncError(f"compression spec {show(dict(spec))} needs 'method' and may "
                                 f"have {', '.join(f.name for f in fields(cls)[1:])}")
            return cls(**spec)
        if not isinstance(spec, str) or not spec.strip():
            raise QSyncError(f"compression spec must be text like 'global_qsgd:8', got "
                             f"{show(spec)}")
        head, *settings = spec.strip().lower().split(",")
        method, _, arg = head.partition(":")
        base = cls(method)
        if arg:
            field = METHODS[method].short
            if field is None or (_FIELD_TYPES[field] is int and not _is_whole(arg)):
                raise QSyncError(f"cannot read compression spec {show(spec)}; write "
                                 f"{_short_forms()}, then any ,field=value settings")
            base = replace(base, **{field: int(arg) if _FIELD_TYPES[field] is int else arg})
        return replace(base, **dict(_setting(item, spec) for item in settings))


@dataclass(frozen=True)
class CompressionSettings:
    """Parameter FQN patterns -> specs (None: uncompressed), in match order."""

    rules: tuple[tuple[str, CompressionSpec | None], ...] = ()

    @classmethod
    def parse(cls, settings: "CompressionSettings | CompressionSpec | str | Mapping | None"
              ) -> "CompressionSettings":
        """Settings from a spec (every parameter: a spec, its short form or its fields as a
        mapping), a mapping pattern -> spec, or None (none)."""
        if isinstance(settings, CompressionSettings):
            return settings
        if settings is None:
            return cls()
        if isinstance(settings, CompressionSpec | str) or _is_spec_mapping(settings):
            return cls(((_DEFAULT_KEY, CompressionSpec.parse(settings)),))
        if not isinstance(settings, Mapping):
            raise QSyncError(f"compression settings must be a spec or a mapping of parameter "
                             f"patterns to specs, got {type(settings).__name__}")
        rules = []
        for pattern, spec in settings.items():
            if not isinstance(pattern, str):
                raise QSyncError(f"compression pattern must be text, got {show(pattern)}")
            if pattern.startswith(_REGEX_PREFIX):
                try:
                    re.compile(pattern[len(_REGEX_PREFIX):])
                except re.error as err:
                    raise QSyncError(f"compression pattern {show(pattern)}: {err}") from None
            rules.append((pattern, None if spec is None else CompressionSpec.parse(spec)))
        rules.sort(key=lambda rule: rule[0] == _DEFAULT_KEY)  # exact and re: rules first
        return cls(tuple(rules))

    def spec_for(self, fqn: str, *, numel: int, ndim: int) -> CompressionSpec | None:
        """The spec of parameter ``fqn`` (None: sent uncompressed)."""
        for pattern, spec in self.rules:
            if pattern == fqn or pattern == _DEFAULT_KEY or (
                    pattern.startswith(_REGEX_PREFIX)
                    and re.fullmatch(pattern[len(_REGEX_PREFIX):], fqn)):
                return spec if spec is not None and spec.applies_to(numel, ndim) else None
        return None

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods some rule uses, sorted."""
        return tuple(sorted({spec.method for _, spec in self.rules if spec is not None}))

    def __bool__(self) -> bool:
        return any(spec is not None for _, spec in self.rules)

    def to_dict(self) -> dict[str, Any]:
        """The settings as a plan stores them (``parse`` reads them back)."""
        return {pattern: None if spec is None else spec.to_dict() for pattern, spec in self.rules}

    def __str__(self) -> str:
        if not self:
            return "none"
        return ", ".join(f"{str(spec) if spec else 'none'}"
                         + ("" if pattern == _DEFAULT_KEY else f" for {pattern}")
                         for pattern, spec in self.rules)


@dataclass(frozen=True)
class Group:
    """Parameters of one bucket that share a spec: their FQNs and ``(start, numel)`` slices
    of the bucket, in bucket order."""

    spec: CompressionSpec | None
    names: tuple[str, ...]
    slices: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.slices)


def bucket_groups(names: list[str], params: list, settings: CompressionSettings
                  ) -> tuple[Group, ...]:
    """A bucket's parameters (anything with ``numel()`` and ``dim()``, as tensors have)
    grouped by spec, uncompressed first, then by spec key.

    Example::

        >>> import torch
        >>> settings = CompressionSettings.parse({"_default": "cgx:4", "b": "fp16"})
        >>> [(str(g.spec), g.slices) for g in bucket_groups(
        ...     ["a", "b", "c"], [torch.zeros(4096), torch.zeros(64, 64), torch.zeros(64, 64)],
        ...     settings)]
        [('None', ((0, 4096),)), ('cgx:4', ((8192, 4096),)), ('fp16', ((4096, 4096),))]
    """
    by_spec: dict[str, list] = defaultdict(list)
    specs: dict[str, CompressionSpec | None] = {}
    start = 0
    for name, param in zip(names, params):
        spec = settings.spec_for(name, numel=param.numel(), ndim=param.dim())
        key = "" if spec is None else spec.key
        specs[key] = spec
        by_spec[key].append((name, (start, param.numel())))
        start += param.numel()
    return tuple(Group(specs[key], tuple(n for n, _ in members), tuple(s for _, s in members))
                 for key, members in sorted(by_spec.items()))


#: a spec's settings (all but the method) -> their types
_FIELD_TYPES = {f.name: f.type for f in fields(CompressionSpec)[1:]}


def _short_forms() -> str:
    """The short forms, as error messages list them.

    Example::

        >>> _short_forms()
        'method[:bits] (global_qsgd:8, cgx:4, qsgd:4), aps[:fp8_e4m3], fp16 or bf16'
    """
    by_bits = ", ".join(f"{m.name}:{m.example}" for m in METHODS.values() if m.short == "bits")
    others = [f"{m.name}[:{m.example}]" for m in METHODS.values()
              if m.short not in (None, "bits")]
    bare = " or ".join(m.name for m in METHODS.values() if m.short is None)
    return ", ".join([f"method[:bits] ({by_bits})", *others, bare])


def _setting(item: str, spec: str) -> tuple[str, Any]:
    """One ``field=value`` of a spec's text, the value typed as the field is."""
    name, eq, text = item.strip().partition("=")
    if not eq or name not in _FIELD_TYPES:
        raise QSyncError(f"cannot read {show(item)} in compression spec {show(spec)}; write "
                         f"field=value with a field among {', '.join(_FIELD_TYPES)}")
    kind = _FIELD_TYPES[name]
    if kind is bool:
        if text not in ("true", "false"):
            raise QSyncError(f"compression spec {show(spec)}: {name} must be true or false")
        return name, text == "true"
    if kind is int:
        if not _is_whole(text):
            raise QSyncError(f"compression spec {show(spec)}: {name} must be a whole number")
        return name, int(text)
    return name, text


def _is_spec_mapping(value: Any) -> bool:
    """A mapping of spec fields (``{"method": "cgx", "bits": 4}``), not of patterns."""
    return (isinstance(value, Mapping) and isinstance(value.get("method"), str)
            and set(value) <= {f.name for f in fields(CompressionSpec)})


def _is_whole(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _positive_int(value: Any, maximum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= maximum
