"""Least-squares lines with their R², shared by the cast and allreduce fits.

Example::

    >>> fit = fit_line([1, 2, 3], [3, 5, 7])
    >>> fit.slope, fit.intercept, fit.r2
    (2.0, 1.0, 1.0)
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qsync_lab.errors import QSyncError

__all__ = ["LineFit", "fit_line"]


@dataclass(frozen=True)
class LineFit:
    """``y = slope·x + intercept`` fitted to ``samples`` points with determination ``r2``."""

    slope: float
    intercept: float
    r2: float
    samples: int


def fit_line(x: Sequence[float], y: Sequence[float], *, relative: bool = False) -> LineFit:
    """Least squares of ``y`` on ``x`` (at least 2 distinct ``x``).

    ``relative=True`` minimises relative residuals ``(y − ŷ) / y`` (``y > 0``): points
    spread over decades (allreduces of 4 KiB to 64 MiB) then each count alike, so the
    intercept comes from the small ones instead of from the noise of the largest.
    R² is ``1 − SS_res / SS_tot`` on ``y`` (1.0 when ``y`` is constant and fitted exactly).

    Example::

        >>> fit_line([1, 10, 100], [2, 11, 101], relative=True).intercept
        1.0
    """
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) != len(y) or len(np.unique(x)) < 2:
        raise QSyncError(f"a line fit needs at least 2 distinct x values (got {len(x)} "
                         f"points, {len(np.unique(x))} distinct)")
    if relative and (y <= 0).any():
        raise QSyncError("a relative line fit needs every y > 0")
    slope, intercept = np.polyfit(x, y, 1, w=1 / y if relative else None)
    residual = float(((y - (slope * x + intercept)) ** 2).sum())
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - residual / total if total > 0 else float(residual == 0)
    return LineFit(round(float(slope), 12), round(float(intercept), 9), r2, len(x))
