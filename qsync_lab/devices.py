"""The device and interconnect catalog: what each GPU (or this CPU) can compute, how fast.

The catalog is read from the shipped ``devices.toml`` and ``links.toml`` plus any TOML
files of the user's own (same schema; their entries replace shipped ones by name). Which
precisions a GPU supports follows from its compute capability and the
``[min_compute_capability]`` rule table in the TOML, never from GPU names in code.

Example::

    >>> from qsync_lab.devices import load_catalog
    >>> catalog = load_catalog()
    >>> t4 = catalog.device("T4")
    >>> [str(p) for p in t4.precision_list], t4.peak_flops_for("int8") / 1e12
    (['fp32', 'fp16', 'int8'], 130.0)
    >>> catalog.link("nvlink2").bandwidth_Bps / 1e9
    150.0
"""

import functools
import math
import os
import re
from collections.abc import Iterable, Mapping
import dataclasses
from dataclasses import dataclass, field
from importlib.resources.abc import Traversable
from types import MappingProxyType
from typing import Literal, TypeVar

import pandas as pd

from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision
from qsync_lab.resources import data_file
from qsync_lab.tomlfile import TomlTable, read_toml

__all__ = ["DeviceCatalog", "DeviceSpec", "LinkSpec", "load_catalog"]

DeviceKind = Literal["gpu", "cpu"]
SCHEMA_VERSION = 1
BYTES_PER_GIB = 2**30
BYTES_PER_GB = 1e9
FLOPS_PER_TFLOPS = 1e12
US_PER_SECOND = 1e6

_MAX_SMS = 4096
_CC_PATTERN = re.compile(r"\d+\.\d+")
_Spec = TypeVar("_Spec")



@dataclass(frozen=True)
class DeviceSpec:
    """One device kind of the catalog, in SI units.

    Attributes:
        name: catalog name, e.g. ``"T4"``.
        kind: ``"gpu"`` or ``"cpu"``.
        vendor: e.g. ``"NVIDIA"``.
        compute_capability: ``(major, minor)`` for a GPU, ``None`` for the CPU.
        memory_bytes: device memory.
        memory_bandwidth_Bps: memory bandwidth in bytes/s.
        peak_flops: dense peak FLOP/s (OP/s for int8) per supported precision.
        precisions: the precisions the device runs (the CPU emulates all of them).
        emulated: True when low precisions are emulated in fp32 arithmetic (the CPU).
        source: where the numbers come from.
        compute_efficiency: op kind -> measured fraction of the peak its ops reach (the
            roofline's factor for those kinds on this device; empty: the defaults).
        memory_efficiency: measured fraction of ``memory_bandwidth_Bps`` a streaming
            copy reaches, the roofline's memory factor for every kind (None: the defaults).
        sm_count: a GPU's streaming multiprocessors (None: not given); a cluster may run
            a rank on a share of them (:meth:`partition`).
    """

    name: str
    kind: DeviceKind
    vendor: str
    compute_capability: tuple[int, int] | None
    memory_bytes: int
    memory_bandwidth_Bps: float
    peak_flops: Mapping[Precision, float] = field(hash=False)
    precisions: frozenset[Precision]
    emulated: bool
    source: str
    compute_efficiency: Mapping[str, float] = field(default_factory=dict, hash=False)
    memory_efficiency: float | None = None
    sm_count: int | None = None

    @property
    def precision_list(self) -> tuple[Precision, ...]:
        """The supported precisions in :class:`Precision` order (widest first)."""
        return tuple(p for p in Precision if p in self.precisions)

    def supports(self, precision: Precision | str) -> bool:
        """True if the device runs ``precision`` (natively, or emulated on the CPU).

        Example::

            >>> t4 = load_catalog().device("T4")
            >>> t4.supports("int8"), t4.supports("bf16")
            (True, False)
        """
        return Precision.parse(precision) in self.precisions

    def require(self, precision: Precision | str) -> Precision:
        """Return ``precision`` parsed, or raise QSyncError if the device lacks it.

        Example::

            >>> v100 = load_catalog().device("V100-SXM2-32GB")
            >>> v100.require("FP16")
            <Precision.FP16: 'fp16'>
            >>> try:
            ...     v100.require("bf16")
            ... except QSyncError as err:
            ...     print(err)
            V100-SXM2-32GB does not support bf16; it supports fp32, fp16: use one of those or another device
        """
        parsed = Precision.parse(precision)
        if parsed not in self.precisions:
            supported = ", ".join(self.precision_list)
            raise QSyncError(
                f"{self.name} does not support {parsed}; it supports {supported}: "
                "use one of those or another device"
            )
        return parsed

    def partition(self, sms: int) -> "DeviceSpec":
        """This GPU restricted to ``sms`` of its multiprocessors (a green context), as a
        device kind of its own, ``<name>/<sms>sm``.

        Its peaks scale with the SM share. So do its memory bandwidth and memory: a first
        model of a GPU shared by several ranks at once (one partition alone can draw more
        bandwidth than its share), to be replaced by measured rows
        (``benchmarks/hybrid_gpu.py``).

        Example::

            >>> part = load_catalog().device("H100-SXM5-80GB").partition(33)
            >>> part.name, part.peak_flops_for("bf16") / 1e12
            ('H100-SXM5-80GB/33sm', 247.35)

        Raises:
            QSyncError: the device is no GPU with a known ``sm_count``, or ``sms`` is not in
                1..sm_count.
        """
        if self.sm_count is None:
            raise QSyncError(f"{self.name} has no sm_count in its catalog entry, so it cannot "
                             "be partitioned; add sm_count = N to it or drop sms")
        if not (isinstance(sms, int) and 0 < sms <= self.sm_count):
            raise QSyncError(f"sms must be an integer in 1..{self.sm_count} for {self.name}, "
                             f"got {sms!r}")
        share = sms / self.sm_count
        return dataclasses.replace(
            self, name=f"{self.name}/{sms}sm", sm_count=sms,
            memory_bytes=int(self.memory_bytes * share),
            memory_bandwidth_Bps=self.memory_bandwidth_Bps * share,
            peak_flops=MappingProxyType({p: v * share for p, v in self.peak_flops.items()}),
            source=f"{self.source}; {sms} of its {self.sm_count} SMs (a green context)")

    def peak_flops_for(self, precision: Precision | str) -> float:
        """Dense peak FLOP/s in ``precision``; QSyncError if unsupported.

        Example::

            >>> load_catalog().device("A100-SXM4-80GB").peak_flops_for("bf16")
            312000000000000.0
        """
        return self.peak_flops[self.require(precision)]


@dataclass(frozen=True)
class LinkSpec:
    """An interconnect as one rank sees it.

    Attributes:
        name: catalog name (``"inline"`` or the table's ``name`` for an inline link).
        bandwidth_Bps: bytes/s per direction.
        latency_s: one-way start-up time of a message.
        source: where the numbers come from.
    """

    name: str
    bandwidth_Bps: float
    latency_s: float
    source: str


@dataclass(frozen=True, eq=False)
class DeviceCatalog:
    """Read-only device and link specs by name (the default one is shared; never mutate).

    Attributes:
        devices: device name -> spec, in file order.
        links: link name -> spec, in file order.
    """

    devices: Mapping[str, DeviceSpec]
    links: Mapping[str, LinkSpec]

    def device(self, name: str) -> DeviceSpec:
        """The device called ``name`` (case-insensitive); QSyncError listing known names.

        Example::

            >>> load_catalog().device("h100-sxm5-80gb").memory_bandwidth_Bps
            3350000000000.0
        """
        return _lookup(self.devices, name, "device")

    def link(self, name_or_table: str | Mapping[str, object]) -> LinkSpec:
        """A named link, or one built from an inline table ``{bandwidth_GBps, latency_us}``.

        Example::

            >>> load_catalog().link({"bandwidth_GBps": 10, "latency_us": 5}).latency_s
            5e-06
        """
        if isinstance(name_or_table, Mapping):
            return parse_link(TomlTable(name_or_table, "inline link"))
        return _lookup(self.links, name_or_table, "link")

    def to_frame(self) -> pd.DataFrame:
        """One row per device: memory, bandwidth, compute capability, precisions, peaks.

        Peak columns are ``peak_tflops_<precision>`` (NaN where unsupported).

        Example::

            >>> load_catalog().to_frame().loc["T4", ["memory_gib", "peak_tflops_fp16"]].tolist()
            [16.0, 65.0]
        """
        rows = [
            {
                "device": spec.name,
                "kind": spec.kind,
                "vendor": spec.vendor,
                "compute_capability": _format_cc(spec.compute_capability),
                "memory_gib": spec.memory_bytes / BYTES_PER_GIB,
                "bandwidth_GBps": spec.memory_bandwidth_Bps / BYTES_PER_GB,
                "precisions": ", ".join(spec.precision_list),
                "emulated": spec.emulated,
                **{
                    f"peak_tflops_{p}": spec.peak_flops.get(p, math.nan) / FLOPS_PER_TFLOPS
                    for p in Precision
                },
            }
            for spec in self.devices.values()
        ]
        return pd.DataFrame(rows).set_index("device")


def load_catalog(*extra_paths: "str | os.PathLike[str]") -> DeviceCatalog:
    """Load the shipped catalog, merged with the user's own TOML files in order.

    A user file may hold ``[min_compute_capability]`` rules, ``[device.<name>]`` and
    ``[link.<name>]`` entries in the shipped schema; an entry replaces the one of the same
    name, a rule replaces the rule for its precision. Without arguments the (cached,
    read-only) shipped catalog is returned.

    Example::

        >>> catalog = load_catalog()
        >>> catalog is load_catalog(), "RTX-4090" in catalog.devices
        (True, True)
    """
    if not extra_paths:
        return _shipped_catalog()
    return _build_catalog((*_shipped_sources(), *extra_paths))


@functools.cache
def _shipped_catalog() -> DeviceCatalog:
    return _build_catalog(_shipped_sources())


def _shipped_sources() -> tuple[Traversable, ...]:
    return data_file("devices.toml"), data_file("links.toml")


@dataclass(frozen=True)
class _Rule:
    """``min_compute_capability.<precision>`` and where it was set."""

    min_cc: tuple[int, int]
    key: str
    file: str

    def describe(self) -> str:
        return f'rule {self.key} = "{_format_cc(self.min_cc)}" in {self.file}'


def _build_catalog(sources: Iterable["Traversable | str | os.PathLike[str]"]) -> DeviceCatalog:
    rules: dict[Precision, _Rule] = {}
    device_tables: dict[str, TomlTable] = {}
    link_tables: dict[str, TomlTable] = {}
    for source in sources:
        document = read_toml(source)
        document.check_keys(("schema_version", "min_compute_capability", "device", "link"))
        document.value("schema_version", str(SCHEMA_VERSION), _is_current_schema, None)
        rule_table = document.table("min_compute_capability", {})
        for name in rule_table.data:
            rules[_parse_precision(rule_table, name)] = _Rule(
                _parse_cc(rule_table, name), f"min_compute_capability.{name}", rule_table.file
            )
        device_tables.update(document.table("device", {}).subtables())
        link_tables.update(document.table("link", {}).subtables())
    devices = {name: _parse_device(name, table, rules) for name, table in device_tables.items()}
    links = {name: parse_link(table, name) for name, table in link_tables.items()}
    return DeviceCatalog(MappingProxyType(devices), MappingProxyType(links))


_DEVICE_KEYS = ("vendor", "kind", "memory_gib", "memory_bandwidth_GBps", "peak_tflops", "source",
                "compute_efficiency", "memory_efficiency")
_GPU_KEYS = (*_DEVICE_KEYS, "compute_capability", "sm_count")
_LINK_KEYS = ("bandwidth_GBps", "latency_us", "source")


def _parse_device(name: str, table: TomlTable, rules: Mapping[Precision, _Rule]) -> DeviceSpec:
    kind = table.value("kind", 'one of "gpu", "cpu"', lambda v: v in ("gpu", "cpu"))
    if kind == "gpu":
        table.check_keys(_GPU_KEYS)
        cc = _parse_cc(table, "compute_capability")
        precisions = frozenset(p for p, rule in rules.items() if cc >= rule.min_cc)
    else:
        table.check_keys(_DEVICE_KEYS)
        cc = None
        precisions = frozenset(Precision)
    return DeviceSpec(
        name=name,
        kind=kind,
        vendor=table.string("vendor"),
        compute_capability=cc,
        memory_bytes=round(table.number("memory_gib") * BYTES_PER_GIB),
        memory_bandwidth_Bps=table.number("memory_bandwidth_GBps") * BYTES_PER_GB,
        peak_flops=_parse_peaks(table.table("peak_tflops"), cc, precisions, rules),
        precisions=precisions,
        emulated=kind == "cpu",
        source=table.string("source"),
        compute_efficiency=_parse_efficiencies(table.table("compute_efficiency", {})),
        memory_efficiency=(table.number("memory_efficiency", maximum=1.0)
                           if "memory_efficiency" in table.data else None),
        sm_count=table.positive_int("sm_count", None, maximum=_MAX_SMS),
    )


def _parse_efficiencies(table: TomlTable) -> Mapping[str, float]:
    """``compute_efficiency``: op kind -> a fraction in (0, 1]."""
    return MappingProxyType({kind: table.number(kind, maximum=1.0) for kind in table.data})


def _parse_peaks(
    table: TomlTable,
    cc: tuple[int, int] | None,
    precisions: frozenset[Precision],
    rules: Mapping[Precision, _Rule],
) -> Mapping[Precision, float]:
    """``peak_tflops`` as FLOP/s, checked to cover exactly ``precisions``."""
    peaks = {
        _parse_precision(table, name): table.number(name) * FLOPS_PER_TFLOPS for name in table.data
    }
    missing = [p for p in Precision if p in precisions and p not in peaks]
    extra = [p for p in Precision if p in peaks and p not in precisions]
    if missing and cc is None:
        raise table.error(
            f"missing {missing[0]}; the cpu kind emulates every precision, so list each "
            "(with the fp32 peak, as emulation runs in fp32)"
        )
    if missing:
        raise table.error(
            f"missing {missing[0]}, which compute capability {_format_cc(cc)} supports "
            f"({rules[missing[0]].describe()}); add its dense peak"
        )
    if extra:
        rule = rules.get(extra[0])
        why = rule.describe() if rule else "no min_compute_capability rule enables it"
        raise table.error(
            f"has {extra[0]}, which compute capability {_format_cc(cc)} does not support "
            f"({why}); remove it or change the rule"
        )
    return MappingProxyType(peaks)


def parse_link(table: TomlTable, name: str | None = None) -> LinkSpec:
    """Build a link from a ``[link.<name>]`` entry, or an inline table when ``name`` is None.

    An inline table may carry its own ``name`` (default ``"inline"``) and ``source``
    (default: where it was written).

    Example::

        >>> inline = TomlTable({"bandwidth_GBps": 12.5, "latency_us": 20}, "my.toml")
        >>> parse_link(inline).bandwidth_Bps
        12500000000.0
    """
    if name is None:
        table.check_keys((*_LINK_KEYS, "name"))
        name = table.string("name", "inline")
        source = table.string("source", table.where())
    else:
        table.check_keys(_LINK_KEYS)
        source = table.string("source")
    return LinkSpec(
        name=name,
        bandwidth_Bps=table.number("bandwidth_GBps") * BYTES_PER_GB,
        latency_s=table.number("latency_us", allow_zero=True) / US_PER_SECOND,
        source=source,
    )


def _lookup(specs: Mapping[str, _Spec], name: str, what: str) -> _Spec:
    if not isinstance(name, str):
        raise QSyncError(f"a {what} is named by text, got {type(name).__name__}; choose one of: "
                         f"{', '.join(specs)}")
    if name in specs:
        return specs[name]
    by_lower = {known.lower(): spec for known, spec in specs.items()}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    raise QSyncError(
        f"unknown {what} {name!r}; choose one of: {', '.join(specs)} "
        "(or define it in your own TOML file passed to load_catalog)"
    )


def _parse_precision(table: TomlTable, name: str) -> Precision:
    try:
        return Precision.parse(name)
    except QSyncError as err:
        raise table.error(str(err), name) from None


def _parse_cc(table: TomlTable, name: str) -> tuple[int, int]:
    text = table.value(
        name,
        'a compute capability string like "7.5"',
        lambda v: isinstance(v, str) and _CC_PATTERN.fullmatch(v) is not None,
    )
    major, minor = text.split(".")
    return int(major), int(minor)


def _format_cc(cc: tuple[int, int] | None) -> str | None:
    return None if cc is None else f"{cc[0]}.{cc[1]}"



def _is_current_schema(value: object) -> bool:
    return type(value) is int and value == SCHEMA_VERSION


