"""Cost model: how long ops, casts, allreduces and optimizer steps take on each device.

Numbers come from measured profile tables where they exist, else from a roofline over the
device catalog scaled by per-kind efficiency factors (calibrated on measured profiles when
given); every number says which (see :mod:`qsync_lab.costs.model`).

Example::

    >>> from qsync_lab.costs import CostModel
    >>> from qsync_lab.cluster import load_cluster
    >>> cluster = load_cluster("qsync-paper")
    >>> CostModel().allreduce_time_us(25 * 2**20, 32, [cluster.link_between(7, 8)]).source
    'alpha-beta:eth_100g'
"""

from qsync_lab.costs.calibrate import CastFit, calibrate_efficiency, fit_cast_costs
from qsync_lab.costs.comm import ring_allreduce_us, ring_wire_bytes, slowest_link
from qsync_lab.costs.model import Cost, CostModel
from qsync_lab.costs.profile_links import (link_metadata, load_cost_model, read_link_fits,
                                          write_device_profile)
from qsync_lab.costs.profiles import PROFILE_COLUMNS, ProfileTable, read_profile, write_profile
from qsync_lab.costs.roofline import DEFAULT_EFFICIENCY, Roofline, default_roofline
from qsync_lab.costs.work import PHASES, OpWork, batch_scales, op_work, phase_work, shape_key

__all__ = [
    "DEFAULT_EFFICIENCY", "PHASES", "PROFILE_COLUMNS", "CastFit", "Cost",
    "CostModel", "OpWork", "ProfileTable", "Roofline", "batch_scales", "calibrate_efficiency",
    "default_roofline", "fit_cast_costs", "link_metadata", "load_cost_model", "op_work",
    "phase_work", "read_link_fits", "read_profile",
    "ring_allreduce_us", "ring_wire_bytes", "shape_key", "slowest_link",
    "write_device_profile", "write_profile",
]
