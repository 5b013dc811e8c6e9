"""``compare_strategies``: one table of every strategy's throughput, risk and memory.

Example::

    >>> import pandas as pd
    >>> import torch, torch.nn as nn
    >>> from qsync_lab.cluster import load_cluster
    >>> from qsync_lab.costs import CostModel
    >>> from qsync_lab.graph import trace_graph
    >>> graph = trace_graph(nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(),
    ...                                   nn.Linear(4096, 1024)), torch.randn(4, 64, 1024))
    >>> scores = pd.DataFrame({("fp16", "risk"): [1.0, 2.0], ("int8", "risk"): [4.0, 8.0]},
    ...                       index=["0", "2"])
    >>> table = compare_strategies(graph, load_cluster("v100-t4-small"), CostModel(), scores)
    >>> table.index.tolist()
    ['fp32', 'uniform-low', 'dynamic-batching', 'qsync', 'joint']
    >>> bool(table.loc["qsync", "indicator_sum"] <= table.loc["uniform-low", "indicator_sum"])
    True
"""

import time
from collections.abc import Callable, Mapping, Sequence

import pandas as pd

from qsync_lab.allocate.baselines import (dynamic_batching, joint_batch_precision,
                                          uniform_low_precision)
from qsync_lab.constraints import Constraints
from qsync_lab.allocate.qsync import allocate, prepared_graph, target_iteration_us
from qsync_lab.cluster import Cluster
from qsync_lab.compress.spec import CompressionSpec
from qsync_lab.costs import CostModel
from qsync_lab.devices import BYTES_PER_GIB
from qsync_lab.graph import OpGraph
from qsync_lab.optimizers import DEFAULT_OPTIMIZER
from qsync_lab.plan import Plan
from qsync_lab.precision import Precision
from qsync_lab.simulate import PlanEvaluator, PreparedGraph, simulate

__all__ = ["STRATEGIES", "compare_strategies", "plan_risk", "plan_summary"]

Strategy = Callable[..., Plan]


def _all_fp32(graph, cluster, costs, indicator, constraints=None, *,
              optimizer=DEFAULT_OPTIMIZER, compression=None) -> Plan:
    return Plan.build(prepared_graph(graph).graph, cluster, {}, strategy="fp32",
                      optimizer=optimizer, compression=compression,
                      constraints=constraints or Constraints())


#: name -> allocator with :func:`~qsync_lab.allocate.allocate`'s interface
STRATEGIES: Mapping[str, Strategy] = {
    "fp32": _all_fp32,
    "uniform-low": uniform_low_precision,
    "dynamic-batching": dynamic_batching,
    "qsync": allocate,
    "joint": joint_batch_precision,
}


def plan_summary(plan: Plan, graph: "OpGraph | PreparedGraph", cluster: Cluster,
                 costs: CostModel, indicator: pd.DataFrame | None) -> dict[str, object]:
    """One row: predicted throughput and iteration time, low-precision ops, summed indicator,
    peak memory and batch per rank per device kind (``kind`` in the column names), with the
    plan's optimizer."""
    prepared = prepared_graph(graph)
    planned = plan.apply_to(cluster)
    sim = simulate(prepared, plan, cluster, costs)
    row: dict[str, object] = {"throughput_samples_per_s": sim.throughput_samples_per_s,
                              "iteration_ms": sim.iteration_us / 1e3}
    for kind, count in plan.low_precision_ops().items():
        row[f"low_precision_ops[{kind}]"] = count
    row["indicator_sum"] = plan_risk(plan, indicator)
    for kind in cluster.device_kinds:
        ranks = [r.rank for r in planned.ranks if r.device == kind]
        row[f"tensor_peak_gib[{kind}]"] = float(sim.tensor_peak_bytes.iloc[ranks].max()
                                                / BYTES_PER_GIB)
        batches = sorted({planned.ranks[r].batch_size for r in ranks})
        row[f"batch[{kind}]"] = "/".join(str(b) for b in batches)
    return row


def plan_risk(plan: Plan, indicator: pd.DataFrame | None) -> float:
    """Summed indicator of every planned op on every device kind (fp32: 0)."""
    if indicator is None:
        return 0.0
    total = 0.0
    for ops in plan.precisions.values():
        for fqn, cfg in ops.items():
            if cfg.forward is not Precision.FP32:
                total += float(indicator.at[fqn, (str(cfg.forward), "risk")])
    return total


def compare_strategies(graph: "OpGraph | PreparedGraph", cluster: Cluster, costs: CostModel,
                       indicator: pd.DataFrame, constraints: Constraints | None = None, *,
                       strategies: Mapping[str, Strategy] | None = None,
                       optimizer: str = DEFAULT_OPTIMIZER,
                       compressions: Sequence = ()) -> pd.DataFrame:
    """Run each strategy and tabulate its plan (one row per strategy, indexed by name),
    then the qsync allocation with each of ``compressions`` (rows ``qsync+<spec>``: the
    allocation knows its communication is compressed).

    Columns: :func:`plan_summary`'s, plus ``compression``, ``meets_target`` (throughput at
    least the constraint's, the uncompressed pace by default) and ``allocation_s`` (the
    strategy's wall time).
    """
    prepared = prepared_graph(graph)
    constraints = constraints or Constraints()
    evaluator = PlanEvaluator(prepared, cluster, costs, optimizer=optimizer)
    floor = cluster.global_batch_size * 1e6 / target_iteration_us(evaluator, constraints)
    runs = [(name, strategy, None) for name, strategy in (strategies or STRATEGIES).items()]
    runs += [(f"qsync+{CompressionSpec.parse(c)}", allocate, c) for c in compressions]
    rows = {}
    for name, strategy, compression in runs:
        start = time.perf_counter()
        plan = strategy(prepared, cluster, costs, indicator, constraints, optimizer=optimizer,
                        compression=compression)
        seconds = time.perf_counter() - start
        row = plan_summary(plan, prepared, cluster, costs, indicator)
        row["compression"] = str(plan.compression_settings)
        row["meets_target"] = row["throughput_samples_per_s"] >= floor * (1 - 1e-9)
        row["allocation_s"] = seconds
        rows[name] = row
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("strategy")
