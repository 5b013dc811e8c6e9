"""Memory-bound kernels: dtype casts, the gradient compressors' encode and decode, optimizer
steps. Each costs a line fitted to measured calls where a profile has one
(:class:`~qsync_lab.costs.CastFit`), else its bytes at the device's memory bandwidth, plus
a launch (:meth:`~qsync_lab.costs.Roofline.traffic_us`).

Example::

    >>> from qsync_lab.costs import default_roofline
    >>> from qsync_lab.devices import load_catalog
    >>> t4 = load_catalog().device("T4")
    >>> roofline = default_roofline().for_device(t4)
    >>> compression_cost(32e6, 8.5, t4, None, roofline)   # 272 MB at 256 GB/s, plus 5 us
    Cost(us=1067.5, source='roofline')
    >>> v100 = load_catalog().device("V100-SXM2-32GB")
    >>> cost = optimizer_cost(440e6, "adam", v100, default_roofline().for_device(v100))
    >>> round(cost.us, 1), cost.source   # 8 x 440 MB at 720 GB/s, plus a launch
    (4893.9, 'roofline')
    >>> in_step_cost(1e6, None)
    Cost(us=0.0, source='not measured')
"""

import numpy as np

from qsync_lab.costs.calibrate import CastFit
from qsync_lab.costs.cost import Cost
from qsync_lab.costs.roofline import Roofline
from qsync_lab.devices import DeviceSpec
from qsync_lab.optimizers import optimizer_state_count
from qsync_lab.precision import Precision

__all__ = ["cast_times_us", "compression_cost", "in_step_cost", "optimizer_cost"]

_CAST_KIND = "cast"
_OPTIMIZER_KIND = "optimizer"


def cast_times_us(numel: np.ndarray, src: Precision, dst: Precision, device: DeviceSpec,
                  fit: CastFit | None, roofline: Roofline) -> tuple[np.ndarray, str]:
    """Time and source of converting tensors of ``numel`` elements from ``src`` to ``dst``:
    the ``fit`` of this pair on ``device``, else read in ``src`` and written in ``dst``."""
    if fit is not None:
        return fit.time_us(numel), fit.source
    return (roofline.traffic_us(numel * (src.bits + dst.bits) / 8, _CAST_KIND, device),
            roofline.source)


def compression_cost(numel: float, bytes_per_element: float, device: DeviceSpec,
                     fit: CastFit | None, roofline: Roofline) -> Cost:
    """One compressor step over ``numel`` elements: its ``fit``, else ``bytes_per_element``
    read and written per element."""
    if fit is not None:
        return Cost(float(fit.time_us(numel)), fit.source)
    times = roofline.traffic_us(np.array([numel * bytes_per_element]), _CAST_KIND, device)
    return Cost(float(times[0]), roofline.source)


def in_step_cost(numel: float, fit: CastFit | None) -> Cost:
    """What one compressed group call of ``numel`` elements adds to a measured DDP step
    beyond the composed estimate: the ``in_step`` ``fit`` (may be negative), else 0."""
    if fit is None:
        return Cost(0.0, "not measured")
    return Cost(float(fit.a_us_per_element * numel + fit.b_us), fit.source)


def optimizer_cost(param_bytes: float, optimizer: str, device: DeviceSpec,
                   roofline: Roofline) -> Cost:
    """One ``optimizer`` step over ``param_bytes`` of fp32 parameters: the non-finite check
    reads the gradients, then the step reads parameters, gradients and state and writes
    parameters and state."""
    traffic = (4 + 2 * optimizer_state_count(optimizer)) * param_bytes
    times = roofline.traffic_us(np.array([float(traffic)]), _OPTIMIZER_KIND, device)
    return Cost(float(times[0]), roofline.source)
