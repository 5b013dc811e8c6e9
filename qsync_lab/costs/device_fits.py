"""The per-device fits a :class:`~qsync_lab.costs.CostModel` takes from profile tables:
rooflines calibrated on their op rows, lines fitted to their cast and compressor rows, and
the step, event and per-precision overheads of their metadata; and those fits copied under
an alias device name (a device emulated on another).

Example::

    >>> from qsync_lab.costs import read_profile
    >>> from qsync_lab.devices import load_catalog
    >>> from qsync_lab.resources import data_file
    >>> fits = profile_fits([read_profile(data_file("profiles", "cpu.csv"))], load_catalog())
    >>> dict(fits["step_overhead_us"]), fits["rooflines"]["cpu"].source
    ({'cpu': 84.573}, 'fit:profile:cpu.csv')
    >>> sorted(aliased(fits["step_overhead_us"], "T4", "cpu").items())
    [('T4', 84.573), ('cpu', 84.573)]
"""

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from qsync_lab.costs.calibrate import calibrate_efficiency, fit_cast_costs, fit_compression_costs
from qsync_lab.costs.profiles import OP_PHASES, ProfileTable
from qsync_lab.devices import DeviceCatalog
from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision

__all__ = ["DEVICE_FIELDS", "aliased", "profile_fits"]

#: the ``CostModel`` fields keyed by device name, or by tuples that start with one
DEVICE_FIELDS = ("rooflines", "cast_fits", "compress_fits", "step_overhead_us",
                 "event_overhead_us", "precision_op_overhead_us")
#: profile metadata keys (and CostModel fields) of the step-overhead fit
_OVERHEAD_KEYS = ("step_overhead_us", "event_overhead_us")
#: profile metadata key prefix of the per-op cost of low precision (``op_overhead_us.bf16``)
_OP_OVERHEAD_PREFIX = "op_overhead_us."


def profile_fits(tables: Sequence[ProfileTable], catalog: DeviceCatalog, *,
                 calibrate: bool = True) -> dict[str, Mapping[Any, Any]]:
    """Field name of :data:`DEVICE_FIELDS` -> that field's fits from ``tables``: a device's
    calibration (``calibrate=True``) from the last table with its op rows, its overheads
    from the first table with them."""
    rooflines, cast_fits, compress_fits = {}, {}, {}
    overheads: dict[str, dict] = {key: {} for key in _OVERHEAD_KEYS}
    op_overheads: dict[tuple[str, Precision], float] = {}
    for table in tables:
        if "device" in table.metadata:
            device_name = catalog.device(table.metadata["device"]).name
            for key in _OVERHEAD_KEYS:
                if key in table.metadata:
                    overheads[key].setdefault(device_name, _metadata_number(table, key))
            for key in table.metadata:
                if key.startswith(_OP_OVERHEAD_PREFIX):
                    precision = Precision.parse(key.removeprefix(_OP_OVERHEAD_PREFIX))
                    op_overheads.setdefault((device_name, precision),
                                            _metadata_number(table, key))
        ops = table.frame[table.frame["phase"].isin(OP_PHASES)]
        if calibrate:
            for name in ops["device"].unique():
                device = catalog.device(name)
                rooflines[device.name] = calibrate_efficiency(ops, device, source=table.source)
        cast_fits.update(fit_cast_costs(table.frame, source=table.source))
        compress_fits.update(fit_compression_costs(table.frame, source=table.source))
    fits = {"rooflines": rooflines, "cast_fits": cast_fits, "compress_fits": compress_fits,
            "precision_op_overhead_us": op_overheads, **overheads}
    return {name: MappingProxyType(fits[name]) for name in DEVICE_FIELDS}


def aliased(fits: Mapping[Any, Any], alias: str, device: str) -> Mapping[Any, Any]:
    """``fits`` plus a copy of each of ``device``'s entries (its name, or a tuple key that
    starts with it) under ``alias``."""
    copies = {}
    for key, value in fits.items():
        if key == device:
            copies[alias] = value
        elif isinstance(key, tuple) and key[0] == device:
            copies[(alias, *key[1:])] = value
    return MappingProxyType({**fits, **copies})


def _metadata_number(table: ProfileTable, key: str) -> float:
    """The leading number of a ``key: <number>; ...`` metadata line."""
    text = table.metadata[key].split(";", 1)[0].strip()
    try:
        return float(text)
    except ValueError:
        raise QSyncError(f"{table.source}: metadata {key!r} must start with a number, "
                         f"got {table.metadata[key]!r}") from None
