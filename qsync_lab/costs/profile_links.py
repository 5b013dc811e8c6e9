"""Write a device profile (op rows, cast rows, link fits) and read its link fits back.

The file is :mod:`qsync_lab.costs.profiles`' CSV. Its metadata lines carry, besides the
software versions, one ``link.<name>`` line per fitted link
(``latency_us=…; bandwidth_GBps=…; r2=…; world_size=…; backend=…``) and one
``cast_r2.<src->dst>`` line per cast fit. :func:`load_cost_model` builds a
:class:`~qsync_lab.costs.CostModel` from such files, with the link fits in ``link_fits``.

Example::

    >>> import tempfile, pathlib
    >>> from qsync_lab.devices import LinkSpec
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "cpu.csv"
    >>> link = LinkSpec("loopback", 2e9, 40e-6, "fit:measured")
    >>> meta = link_metadata(link, r2=0.99, world_size=2, backend="gloo")
    >>> write_device_profile(path, [], {"device": "cpu", **meta})
    >>> fit = read_link_fits(path)["loopback"]
    >>> fit.bandwidth_Bps, round(fit.latency_s * 1e6, 3), fit.source
    (2000000000.0, 40.0, 'fit:profile:cpu.csv (R2 0.9900, gloo, 2 ranks)')
"""

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import pandas as pd

from qsync_lab.costs.model import CostModel
from qsync_lab.costs.profiles import PROFILE_COLUMNS, read_profile, write_profile
from qsync_lab.devices import LinkSpec
from qsync_lab.errors import QSyncError

__all__ = ["link_metadata", "load_cost_model", "read_link_fits", "write_device_profile"]

_LINK_PREFIX = "link."
_GB = 1e9
_US = 1e6


def link_metadata(link: LinkSpec, *, r2: float, world_size: int,
                  backend: str) -> dict[str, str]:
    """The metadata line of a fitted link."""
    return {f"{_LINK_PREFIX}{link.name}": (
        f"latency_us={link.latency_s * _US:.4f}; bandwidth_GBps={link.bandwidth_Bps / _GB:.6f}; "
        f"r2={r2:.4f}; world_size={world_size}; backend={backend}")}


def write_device_profile(path: "str | os.PathLike[str]", frames: Iterable[pd.DataFrame],
                         metadata: Mapping[str, str]) -> None:
    """Concatenate row frames (op and cast rows) and write them with ``metadata``."""
    frames = [f for f in frames if len(f)]
    rows = (pd.concat(frames, ignore_index=True) if frames
            else pd.DataFrame(columns=list(PROFILE_COLUMNS)))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_profile(path, rows, metadata)


def read_link_fits(path: "str | os.PathLike[str]") -> dict[str, LinkSpec]:
    """The fitted links of a profile (name -> :class:`LinkSpec`), from its metadata."""
    table = read_profile(path)
    fits = {}
    for key, value in table.metadata.items():
        if not key.startswith(_LINK_PREFIX):
            continue
        fields = dict(part.strip().split("=", 1) for part in value.split(";") if "=" in part)
        try:
            latency_s = float(fields["latency_us"]) / _US
            bandwidth = float(fields["bandwidth_GBps"]) * _GB
            if not (0 <= latency_s < math.inf and 0 < bandwidth < math.inf):
                raise ValueError
        except (KeyError, ValueError):
            raise QSyncError(f"profile {path}: metadata {key!r} needs latency_us=<number >= 0>; "
                             f"bandwidth_GBps=<number > 0>, got {value!r}; measure the link "
                             "again (qsync-lab profile)") from None
        name = key[len(_LINK_PREFIX):]
        fits[name] = LinkSpec(name, bandwidth, latency_s,
                              f"fit:{table.source} (R2 {float(fields.get('r2', 'nan')):.4f}, "
                              f"{fields.get('backend', '?')}, {fields.get('world_size', '?')} "
                              "ranks)")
    return fits


def load_cost_model(*paths: "str | os.PathLike[str]") -> CostModel:
    """:meth:`CostModel.from_profiles` of ``paths`` plus their measured link fits (a later
    file's fit of a link wins)."""
    links: dict[str, LinkSpec] = {}
    for path in paths:
        links.update(read_link_fits(path))
    return dataclasses.replace(CostModel.from_profiles(*paths), link_fits=links)
