"""The tuner's re-plan, without widgets: a study and the control values in; the plan, its
simulation and its figures out (:func:`replan`). The strategy comparison re-plans every
strategy, several times a re-plan's cost, so it is drawn apart, when asked
(:func:`compare_result`).

Example::

    >>> from qsync_lab import Study
    >>> study = Study("digits_cnn", cluster="local-hybrid", progress=False)
    >>> result = replan(study, TunerSettings(strategy="uniform-low", counts={"T4": 2}))
    >>> result.plan.low_precision_ops(), result.sim.world_size
    ({'V100-SXM2-32GB': 0, 'T4': 6}, 3)
    >>> sorted(result.figures)
    ['indicator', 'memory', 'precision_map', 'timeline']
    >>> compare_result(result).data[0].x[:3]
    ('fp32', 'uniform-low', 'dynamic-batching')
"""

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import plotly.graph_objects as go

from qsync_lab.plan import Plan
from qsync_lab.viz import (plot_comparison, plot_indicator, plot_memory, plot_precision_map,
                           plot_timeline)
from qsync_lab.widgets.shape import reshape_cluster

if TYPE_CHECKING:
    from qsync_lab.simulate import SimResult
    from qsync_lab.study import Study

__all__ = ["FIGURES", "TunerResult", "TunerSettings", "compare_result", "replan"]

#: the figures of a re-plan, in the tuner's tab order (the comparison's tab is the fourth)
FIGURES = ("timeline", "memory", "indicator", "precision_map")
_TOP_OPS = 40  # the indicator figure's most sensitive ops


@dataclass(frozen=True)
class TunerSettings:
    """What the tuner's controls say.

    Attributes:
        counts: device kind -> ranks (kinds left out keep the study cluster's count).
        batch_sizes: device kind -> per-rank batch size (kinds left out keep theirs).
        memory_gib: device kind -> per-rank memory budget (default: the device's memory).
        throughput_samples_per_s: the least throughput (None: the fastest kind's fp32 pace).
        strategy: a name of :data:`qsync_lab.allocate.STRATEGIES`.
        compression: a gradient compression spec (``"global_qsgd:8"``), None for none.
    """

    counts: Mapping[str, int] = field(default_factory=dict)
    batch_sizes: Mapping[str, int] = field(default_factory=dict)
    memory_gib: Mapping[str, float] = field(default_factory=dict)
    throughput_samples_per_s: float | None = None
    strategy: str = "qsync"
    compression: str | None = None


@dataclass(frozen=True)
class TunerResult:
    """One re-plan.

    Attributes:
        study: the study on the settings' cluster
            (:meth:`~qsync_lab.study.Study.on_cluster`).
        settings: what it was planned under.
        memory_gib: the settings' budgets of the cluster's device kinds (what was planned
            under; a kind left out had its device's memory).
        plan, sim: the plan and its simulated iteration.
        figures: name (:data:`FIGURES`) -> figure.
        seconds: wall time of the re-plan, figures included.
    """

    study: "Study"
    settings: TunerSettings
    memory_gib: Mapping[str, float]
    plan: Plan
    sim: "SimResult"
    figures: Mapping[str, go.Figure]
    seconds: float


def replan(study: "Study", settings: TunerSettings) -> TunerResult:
    """Plan and simulate ``settings`` on ``study`` (on the settings' cluster composition:
    :meth:`~qsync_lab.study.Study.on_cluster`, which keeps its warm allocator) and draw the
    :data:`FIGURES`.

    Raises:
        QSyncError: the settings have no plan (the one-line reason, e.g. the best
            reachable iteration time against the target's).
    """
    start = time.perf_counter()
    cluster = reshape_cluster(study.cluster, counts=settings.counts,
                              batch_sizes=settings.batch_sizes)
    tuned = study.on_cluster(cluster)
    memory_gib = {k: v for k, v in settings.memory_gib.items() if k in cluster.device_kinds}
    plan = tuned.plan(memory_limit=memory_gib,
                      throughput_target=settings.throughput_samples_per_s,
                      strategy=settings.strategy, compression=settings.compression)
    sim = tuned.simulate(plan)
    lowest = str(tuned.low_precisions[-1])
    scores = tuned.indicator()
    scored = scores[scores[(lowest, "omega")].notna()]  # ops with no kernel there have none
    figures = {
        "timeline": plot_timeline(sim),
        "memory": plot_memory(sim, plan.cluster, memory_gib=memory_gib),
        "indicator": plot_indicator(scored, lowest, top=_TOP_OPS,
                                    title=f"indicator at {lowest}, most sensitive ops first"),
        "precision_map": plot_precision_map(plan, tuned.graph),
    }
    return TunerResult(tuned, settings, memory_gib, plan, sim, figures,
                       time.perf_counter() - start)


def compare_result(result: TunerResult) -> go.Figure:
    """Every strategy compared under ``result``'s constraints (its compression too, as the
    qsync plan's), drawn (:meth:`~qsync_lab.study.Study.compare`).

    Raises:
        QSyncError: a strategy of the comparison has no plan under them.
    """
    settings = result.settings
    table = result.study.compare(
        memory_limit=dict(result.memory_gib), throughput_target=settings.throughput_samples_per_s,
        compressions=[settings.compression] if settings.compression else ())
    return plot_comparison(table)
