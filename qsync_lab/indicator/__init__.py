"""Sensitivity indicators: which operators can run in low precision with the least damage.

Example::

    >>> from qsync_lab.indicator import indicator, collect_statistics, noise_energy
"""

from qsync_lab.indicator.formats import noise_energy, noise_variance, operand_noise
from qsync_lab.indicator.scores import indicator, scores_from_statistics
from qsync_lab.indicator.statistics import collect_statistics

__all__ = ["collect_statistics", "indicator", "noise_energy", "noise_variance", "operand_noise",
           "scores_from_statistics"]
