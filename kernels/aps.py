"""APS: the exponent shared across workers, its power-of-two shift, scaled rounding."""

import math

from . import floatfmt
from . import reference as ref
from .floats import _format_tuple, _round
from .plumbing import _backend, _check_float, _check_workers
from .reductions import _finite_absmax

APS_ZERO_EXPONENT = ref.APS_ZERO_EXPONENT


def aps_exponent(x, n_workers, *, backend="auto"):
    """APS: this worker's ``ceil(log2(max |n_workers · x|))`` (all-reduce MAX it across workers).

    An all-zero tensor gives ``APS_ZERO_EXPONENT`` (-150, below any real exponent) instead
    of CPD's -inf. NaN/Inf raise QSyncError.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import aps_exponent
        >>> aps_exponent(torch.tensor([0.3, -1.5]), 4)
        3
    """
    _check_float(x)
    _check_workers(n_workers)
    amax = float(_finite_absmax(x, None, _backend(x, backend)))
    if amax == 0:
        return APS_ZERO_EXPONENT
    frac, ex = math.frexp(amax * n_workers)
    return ex if frac > 0.5 else ex - 1


def aps_shift(exponent, fmt):
    """APS: the power-of-two shift ``(2**(e-1) - 1) - exponent`` for format ``fmt``.

    Example::

        >>> from qsync_lab.kernels import aps_shift
        >>> aps_shift(3, (5, 2))
        12
    """
    return ref.aps_shift(int(exponent), _format_tuple(fmt))


def aps_quantize(x, shift, fmt, *, backend="auto", out=None):
    """APS: round ``x · 2**shift`` (exact scaling) to ``fmt``; the values stay scaled.

    ``out``: optional contiguous float32 tensor of x's shape and device.

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import aps_quantize
        >>> aps_quantize(torch.tensor([0.3]), 4, (5, 2)).tolist()
        [5.0]
    """
    _check_float(x)
    p1, p2 = ref.pow2_factors(int(shift))
    return _round(x, _format_tuple(fmt), p1, p2, _backend(x, backend), out)


def aps_dequantize(y, shift, *, backend="auto"):
    """APS: undo the scaling, ``y · 2**-shift`` (float32).

    Example::

        >>> import torch
        >>> from qsync_lab.kernels import aps_dequantize
        >>> aps_dequantize(torch.tensor([5.0]), 4).tolist()
        [0.3125]
    """
    _check_float(y, "y")
    p1, p2 = ref.pow2_factors(-int(shift))
    return _round(y, floatfmt.FP32, p1, p2, _backend(y, backend))
