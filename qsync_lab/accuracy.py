"""Accuracy studies: the table of a study's runs and paired tests between strategies.

A study trains every (task, strategy) pair under several seeds; a seed fixes the initial
weights, the data and its order, so the runs of one seed form a pair across strategies and
two strategies are compared by a paired test over the seeds (:func:`paired_test`), not by
eyeballing means. With 3 seeds a paired t-test has little power: "within noise" then means
that the seeds could not tell the strategies apart, not that they train equally well.

``runs`` below is a DataFrame with one row per run: columns ``task``, ``strategy``, ``seed``,
the metric (``test_accuracy``, ...) and per-plan columns (predicted throughput,
low-precision ops) that are the same for every seed of a (task, strategy).

Example::

    >>> import pandas as pd
    >>> runs = pd.DataFrame({"task": ["t"] * 6, "seed": [0, 1, 2] * 2,
    ...                      "strategy": ["qsync"] * 3 + ["uniform"] * 3,
    ...                      "test_accuracy": [0.91, 0.93, 0.92, 0.90, 0.91, 0.91],
    ...                      "throughput": [100.0] * 3 + [99.5] * 3})
    >>> summary_table(runs, "test_accuracy", plan_columns=["throughput"])
                     n   mean    std  throughput
    task strategy
    t    qsync       3  0.920  0.010       100.0
         uniform     3  0.907  0.006        99.5
    >>> tests = paired_tests(runs, "test_accuracy", reference="qsync", against=["uniform"],
    ...                      throughput="throughput")
    >>> tests[["mean_difference", "p_value", "verdict", "claim_holds"]].round(3)
                  mean_difference  p_value       verdict  claim_holds
    task against
    t    uniform            0.013    0.057  within noise         True
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from qsync_lab.errors import QSyncError

__all__ = ["PairedTest", "paired_test", "paired_tests", "summary_table"]

#: significance level of the verdicts
ALPHA = 0.05
#: the claim's speed condition: the reference reaches this share of the other's throughput
THROUGHPUT_SHARE = 0.99


@dataclass(frozen=True)
class PairedTest:
    """A paired t-test of ``a - b`` over seeds (:func:`paired_test`).

    Attributes:
        n: pairs (seeds).
        mean_difference: mean of ``a - b``.
        statistic: the t statistic (0 when every pair is equal).
        p_value: two-sided p-value (1 when every pair is equal).
    """

    n: int
    mean_difference: float
    statistic: float
    p_value: float

    def verdict(self, *, higher_is_better: bool = True, alpha: float = ALPHA) -> str:
        """Whether ``a`` did ``"better"`` or ``"worse"`` than ``b``, or ``"within noise"``
        (p >= ``alpha``).

        Example::

            >>> PairedTest(3, -0.02, -9.0, 0.01).verdict()
            'worse'
            >>> PairedTest(3, -0.02, -9.0, 0.01).verdict(higher_is_better=False)
            'better'
        """
        if not self.p_value < alpha:
            return "within noise"
        return "better" if (self.mean_difference > 0) == higher_is_better else "worse"


def paired_test(a: Sequence[float], b: Sequence[float]) -> PairedTest:
    """Paired two-sided t-test of ``a`` against ``b`` (``scipy.stats.ttest_rel``).

    Pairs that are all equal (the same run twice) test as no difference (p = 1), where
    scipy would return NaN.

    Example::

        >>> paired_test([0.9, 0.8, 0.7], [0.9, 0.8, 0.7])
        PairedTest(n=3, mean_difference=0.0, statistic=0.0, p_value=1.0)

    Raises:
        QSyncError: unequal lengths, fewer than 2 pairs, or a non-finite value.
    """
    from scipy import stats

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or len(a) < 2:
        raise QSyncError(f"a paired test needs two equal-length series of at least 2 values "
                         f"(one per seed), got {len(a)} and {len(b)}; run more seeds")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise QSyncError("a paired test got NaN or Inf; check the runs' metrics (a diverged "
                         "run?)")
    difference = a - b
    if not difference.any():
        return PairedTest(len(a), 0.0, 0.0, 1.0)
    result = stats.ttest_rel(a, b)
    return PairedTest(len(a), float(difference.mean()), float(result.statistic),
                      float(result.pvalue))


def summary_table(runs: pd.DataFrame, metric: str, *, plan_columns: Sequence[str] = (),
                  decimals: int = 3) -> pd.DataFrame:
    """Per task and strategy (in the order the runs list them): number of seeds, mean and
    sample std of ``metric`` rounded to ``decimals``, and each of ``plan_columns`` (one
    value per strategy, e.g. the predicted throughput), unrounded.

    Raises:
        QSyncError: a missing column, or a plan column that differs between seeds.
    """
    _check_columns(runs, ["task", "strategy", metric, *plan_columns])
    grouped = runs.groupby(["task", "strategy"], sort=False)
    table = grouped[metric].agg(n="count", mean="mean", std="std").round(decimals)
    for column in plan_columns:
        if (grouped[column].nunique(dropna=False) > 1).any():
            raise QSyncError(f"column {column!r} differs between the seeds of one strategy; "
                             "pass only per-plan columns as plan_columns")
        table[column] = grouped[column].first()
    return table


def paired_tests(runs: pd.DataFrame, metric: str, *, reference: str, against: Sequence[str],
                 throughput: str, higher_is_better: bool = True) -> pd.DataFrame:
    """Per task, ``reference`` against each strategy of ``against``, paired by seed.

    Columns: ``n``, the two means, ``mean_difference`` (reference minus the other),
    ``p_value``, ``verdict`` (the reference did ``"better"``, ``"worse"`` or ``"within
    noise"``), ``throughput_share`` (reference's ``throughput`` over the other's) and
    ``claim_holds``: the reference's mean is at least as good and its throughput at least
    :data:`THROUGHPUT_SHARE` of the other's. Indexed by (task, against).

    Raises:
        QSyncError: a missing column, or a strategy without a run for some seed.
    """
    _check_columns(runs, ["task", "strategy", "seed", metric, throughput])
    rows = {}
    for task, runs_of_task in runs.groupby("task", sort=False):
        by_seed = runs_of_task.pivot(index="seed", columns="strategy", values=metric)
        speed = runs_of_task.groupby("strategy")[throughput].first()
        for other in against:
            pair = by_seed[[reference, other]] if {reference, other} <= set(by_seed) else None
            if pair is None or pair.isna().any().any():
                raise QSyncError(f"task {task!r}: {reference!r} and {other!r} need a run for "
                                 "every seed; run the study with both strategies")
            test = paired_test(pair[reference], pair[other])
            means = pair.mean()
            share = speed[reference] / speed[other]
            better = means[reference] >= means[other] if higher_is_better \
                else means[reference] <= means[other]
            rows[(task, other)] = {
                "n": test.n, f"mean_{reference}": means[reference], "mean_other": means[other],
                "mean_difference": test.mean_difference, "p_value": test.p_value,
                "verdict": test.verdict(higher_is_better=higher_is_better),
                "throughput_share": share,
                "claim_holds": bool(better and share >= THROUGHPUT_SHARE - 1e-12)}
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index = pd.MultiIndex.from_tuples(table.index, names=["task", "against"])
    return table


def _check_columns(runs: pd.DataFrame, columns: Sequence[str]) -> None:
    missing = [c for c in columns if c not in runs.columns]
    if missing:
        raise QSyncError(f"the runs table lacks column {missing[0]!r} (has: "
                         f"{', '.join(map(str, runs.columns))})")
