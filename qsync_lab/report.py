"""A plan's report (``qsync-lab report``): one self-contained HTML file.

The report holds the plan's summary (model, cluster, what it was made under: strategy,
memory budgets and throughput target; low-precision ops per device kind, the predicted
step time and throughput, each class of ranks' predicted time and memory), the strategies
compared on the same model and cluster under the plan's own constraints (the defaults for
a plan that does not record them), and the figures of
:mod:`qsync_lab.viz` (timeline, memory, precision map, strategies, indicator). plotly.js
is inlined once, so the file opens without a network.

Example::

    >>> import tempfile, pathlib
    >>> from qsync_lab.study import Study
    >>> study = Study("digits_mlp", cluster="local-hybrid", progress=False)
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "report.html"
    >>> write_report(study.plan(), path, study=study) == path
    True
    >>> path.read_text(encoding="utf-8").count('class="plotly-graph-div"')
    5
"""

import html
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from qsync_lab.errors import QSyncError
from qsync_lab.io import atomic_write_text, check_output_file
from qsync_lab.plan import Plan
from qsync_lab.precision import Precision

if TYPE_CHECKING:
    from qsync_lab.study import Study

__all__ = ["build_report", "compare_as_planned", "plan_study", "precision_counts",
           "rank_classes", "write_report"]

#: the indicator figure draws this many of the most sensitive ops
INDICATOR_TOP_OPS = 30
_STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1400px}"
          "table{border-collapse:collapse;margin:0.5em 0 1.5em}"
          "th,td{border:1px solid #ccc;padding:0.2em 0.6em;text-align:right}"
          "th{background:#f3f3f3;max-width:9em;overflow-wrap:anywhere}")  # long headers wrap


def write_report(plan: "Plan | str | os.PathLike[str]", out: "str | os.PathLike[str]", *,
                 study: "Study | None" = None, comparison: pd.DataFrame | None = None,
                 profiles: Sequence["str | os.PathLike[str]"] = (),
                 calibration_batches: int = 2) -> Path:
    """Write :func:`build_report`'s page for ``plan`` (a :class:`~qsync_lab.plan.Plan` or
    its file) to ``out`` atomically (its folder made if missing); returns ``out``.

    Raises:
        QSyncError: ``out`` cannot be written (:func:`~qsync_lab.io.check_output_file`) or
            is the plan's or a profile's file, or the plan is unreadable or not of
            ``study``'s model and cluster, in one line.

    Example: ``write_report("paper_plan.json", "paper_report.html")``.
    """
    path = check_output_file(out, "--out", inputs=(
        None if isinstance(plan, Plan) else plan, *profiles))
    page = build_report(plan if isinstance(plan, Plan) else Plan.load(plan), study=study,
                        comparison=comparison, profiles=profiles,
                        calibration_batches=calibration_batches)
    try:
        atomic_write_text(path, page)
    except OSError as err:
        raise QSyncError(f"cannot write {path}: {err.strerror or err}") from None
    return path


def build_report(plan: Plan, *, study: "Study | None" = None,
                 comparison: pd.DataFrame | None = None,
                 profiles: Sequence["str | os.PathLike[str]"] = (),
                 calibration_batches: int = 2) -> str:
    """The HTML page of ``plan``'s report.

    Args:
        plan: the plan.
        study: the :class:`~qsync_lab.study.Study` of its model and cluster (default:
            :func:`plan_study`, with ``profiles`` and ``calibration_batches``).
        comparison: ``study.compare()``'s table, if already computed.

    Example: ``build_report(Plan.load("plan.json")).startswith("<!DOCTYPE html>")``.
    """
    study = study or plan_study(plan, profiles=profiles,
                                calibration_batches=calibration_batches)
    plan.validate(study.graph, study.cluster)
    sim = study.simulate(plan)
    comparison = compare_as_planned(plan, study) if comparison is None else comparison
    under = ("the plan's constraints" if plan.constraints is not None else
             "default constraints: the plan does not record its own")
    title = f"{study.name} on {study.cluster.name}: {plan.strategy or 'plan'}"
    body = [f"<h1>{html.escape(title)}</h1>",
            _table("Plan", _overview(plan, sim), header=False),
            _table("Low-precision ops per device kind (forward/backward; the rest run fp32)",
                   precision_counts(plan)),
            _table("Predicted per class of ranks (the slowest and largest rank of each)",
                   rank_classes(sim)),
            _table(f"Strategies compared ({under})", comparison),
            "<h2>Figures</h2>", *_figures(plan, study, sim, comparison)]
    return _page(title, "\n".join(body))


def compare_as_planned(plan: Plan, study: "Study") -> pd.DataFrame:
    """Every strategy re-planned under the constraints ``plan`` was made under (its memory
    budgets, throughput target and, as a ``qsync+<spec>`` row, its compression; the
    defaults for a plan that records none): ``study.compare``'s table.

    Example: ``compare_as_planned(plan, plan_study(plan)).loc["qsync"]``.
    """
    constraints = plan.constraints
    rules = plan.compression_settings.rules
    compressions = ([str(rules[0][1])] if len(rules) == 1 and rules[0][0] == "_default"
                    and rules[0][1] is not None else [])
    if constraints is None:
        return study.compare(compressions=compressions)
    return study.compare(memory_limit=dict(constraints.memory_gib),
                         throughput_target=constraints.throughput_samples_per_s,
                         compressions=compressions)


def plan_study(plan: Plan, *, profiles: Sequence["str | os.PathLike[str]"] = (),
               calibration_batches: int = 2) -> "Study":
    """The :class:`~qsync_lab.study.Study` of ``plan``'s zoo model on its cluster (the
    cluster's own batch sizes: the strategies start from them), with the plan's optimizer.

    Example: ``plan_study(Plan.load("plan.json")).simulate(plan)``.
    """
    from qsync_lab.cluster import cluster_from_definition
    from qsync_lab.study import Study

    if not plan.model_name:
        raise QSyncError("the plan is not of a zoo model; pass study=Study(your_module, ...) "
                         "to build its report")
    definition = plan.to_dict()["_data"]["cluster"]["definition"]
    cluster = cluster_from_definition(definition, origin="the plan's cluster")
    return Study(plan.model_name, cluster=cluster, model_kwargs=plan.model_kwargs,
                 profiles=profiles, calibration_batches=calibration_batches,
                 optimizer=plan.optimizer)


def precision_counts(plan: Plan) -> pd.DataFrame:
    """Per device kind (rows), how many ops the plan runs in each low precision pair
    ``forward/backward`` (columns), and their total ``low_precision_ops``.

    Example::

        >>> import torch, torch.nn as nn
        >>> from qsync_lab.cluster import load_cluster
        >>> from qsync_lab.graph import trace_graph
        >>> graph = trace_graph(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
        ...                     torch.randn(2, 8))
        >>> plan = Plan.build(graph, load_cluster("local-hybrid"),
        ...                   {"T4": {"0": "fp16", "1": "int8"}})
        >>> precision_counts(plan).to_dict("index")["T4"]
        {'fp16/fp16': 1, 'int8/fp16': 1, 'low_precision_ops': 2}
    """
    counts = {kind: Counter(f"{cfg.forward}/{cfg.backward_precision}"
                            for cfg in ops.values() if not cfg.is_fp32)
              for kind, ops in plan.precisions.items()}
    table = pd.DataFrame.from_dict(counts, orient="index").fillna(0).astype(int)
    table = table.reindex(sorted(table.columns), axis=1)
    table["low_precision_ops"] = pd.Series(plan.low_precision_ops())
    return table.rename_axis("device kind")


def rank_classes(sim) -> pd.DataFrame:
    """One row per device kind and batch size of a :class:`~qsync_lab.simulate.SimResult`:
    how many ranks, and the largest busy and idle time (ms) and tensor peak (GiB) among
    them.

    Example::

        >>> import torch, torch.nn as nn
        >>> from qsync_lab.cluster import load_cluster
        >>> from qsync_lab.graph import trace_graph
        >>> from qsync_lab.simulate import simulate
        >>> graph = trace_graph(nn.Linear(8, 8), torch.randn(2, 8))
        >>> rank_classes(simulate(graph, {}, load_cluster("local-hybrid"))).columns.tolist()
        ['ranks', 'busy_ms', 'idle_ms', 'tensor_peak_gib']
    """
    table = sim.rank_summary().groupby(["device", "batch_size"]).agg(
        ranks=("busy_us", "size"), busy_ms=("busy_us", "max"), idle_ms=("idle_us", "max"),
        tensor_peak_gib=("tensor_peak_gib", "max"))
    table[["busy_ms", "idle_ms"]] /= 1e3
    return table


def _overview(plan: Plan, sim) -> pd.DataFrame:
    kinds = pd.Series(sim.rank_devices).value_counts(sort=False)
    kwargs = f" {dict(plan.model_kwargs)}" if plan.model_kwargs else ""
    rows = {
        "model": f"{plan.model_name}{kwargs} (fingerprint {plan.model_fingerprint})",
        "cluster": f"{plan.cluster_name}: {plan.world_size} ranks, "
                   + ", ".join(f"{n} x {kind}" for kind, n in kinds.items()),
        "strategy": plan.strategy or "-",
        "made under": (plan.constraints.describe(plan.cluster) if plan.constraints is not None
                       else "constraints not recorded (a plan file from before plans recorded "
                       "them): the comparison below uses the defaults"),
        "optimizer": plan.optimizer,
        "gradient compression": str(plan.compression_settings) or "none",
        "predicted step time (ms)": _number(sim.iteration_us / 1e3),
        "predicted throughput (samples/s)": _number(sim.throughput_samples_per_s),
        "predicted tensor peak of the largest rank (GiB)":
            _number(sim.tensor_peak_bytes.max() / 2**30),
    }
    return pd.DataFrame({"value": rows})


def _figures(plan: Plan, study: "Study", sim, comparison: pd.DataFrame) -> list[str]:
    """Every figure as a ``<div>`` (plotly.js is on the page once, not in them)."""
    from qsync_lab.viz import (plot_comparison, plot_indicator, plot_memory,
                               plot_precision_map, plot_timeline)

    figures = [plot_timeline(sim), plot_memory(sim, plan.cluster),
               plot_precision_map(plan, study.graph), plot_comparison(comparison)]
    precision = _indicator_precision(plan, study)
    if precision is not None:
        figures.append(plot_indicator(study.indicator(), precision, top=INDICATOR_TOP_OPS,
                                      title=f"the {INDICATOR_TOP_OPS} ops most sensitive to "
                                      f"{precision} (indicator ω)"))
    return [fig.to_html(full_html=False, include_plotlyjs=False) for fig in figures]


def _indicator_precision(plan: Plan, study: "Study") -> str | None:
    """The plan's most used low forward precision, else the cluster's first (None: the
    cluster has none)."""
    used = Counter(str(cfg.forward) for ops in plan.precisions.values()
                   for cfg in ops.values() if cfg.forward is not Precision.FP32)
    if used:
        return used.most_common(1)[0][0]
    return str(study.low_precisions[0]) if study.low_precisions else None


def _table(heading: str, frame: pd.DataFrame, *, header: bool = True) -> str:
    return (f"<h2>{html.escape(heading)}</h2>\n"
            + frame.to_html(float_format=_number, border=0, header=header))


def _number(value: float) -> str:
    """Three decimals, or three significant digits below 0.1 (so a column of GiB reads
    ``1.000`` beside ``1.117``, never ``1``).

    Example::

        >>> [_number(x) for x in (1234.5, 0.99999, 0.258, 0.00134)]
        ['1,234.500', '1.000', '0.258', '0.00134']
    """
    return f"{value:,.3f}" if abs(value) >= 0.1 else f"{value:.3g}"


def _page(title: str, body: str) -> str:
    from plotly.offline import get_plotlyjs

    return (f'<!DOCTYPE html>\n<html>\n<head>\n<meta charset="utf-8">\n'
            f"<title>{html.escape(title)}</title>\n<style>{_STYLE}</style>\n"
            f'<script type="text/javascript">{get_plotlyjs()}</script>\n</head>\n'
            f"<body>\n{body}\n</body>\n</html>\n")
