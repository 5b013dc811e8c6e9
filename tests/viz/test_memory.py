"""``plot_memory``: the stacked components are the simulator's memory breakdown, they add up
to its peak, and each rank's limit is its device's memory or the given budget."""

import pytest

from qsync_lab.cluster import load_cluster
from qsync_lab.errors import QSyncError
from qsync_lab.simulate import MEMORY_COMPONENTS
from qsync_lab.viz import plot_memory

GIB = 2**30


def test_stacks_are_the_breakdown_and_add_up_to_the_peak(sim, cluster):
    fig = plot_memory(sim, cluster)
    bars, limit = fig.data[:-1], fig.data[-1]
    assert fig.layout.barmode == "stack"
    assert [t.name for t in bars] == list(MEMORY_COMPONENTS)
    for trace in bars:
        assert list(trace.y) == pytest.approx((sim.memory_breakdown[trace.name] / GIB).tolist())
    totals = [sum(t.y[i] for t in bars) for i in range(2)]
    assert totals == pytest.approx((sim.tensor_peak_bytes / GIB).tolist())
    assert totals[0] != pytest.approx(totals[1])  # the plan differs per kind
    assert list(limit.x) == ["rank 0 (V100-SXM2-32GB)", "rank 1 (T4)"]
    assert list(limit.y) == [cluster.device_of(r).memory_bytes / GIB for r in (0, 1)]


def test_a_budget_replaces_the_device_memory_and_ranks_select_bars(sim, cluster):
    fig = plot_memory(sim, cluster, memory_gib={"t4": 4.5}, ranks=[1])
    assert list(fig.data[-1].y) == [4.5]
    assert all(list(t.x) == ["rank 1 (T4)"] for t in fig.data)


def test_bad_input_raises_one_line_errors(sim, cluster):
    with pytest.raises(QSyncError, match="is not the one simulated"):
        plot_memory(sim, load_cluster("v100-t4-small"))
    with pytest.raises(QSyncError, match="rank 2 is out of range"):
        plot_memory(sim, cluster, ranks=[2])
    with pytest.raises(QSyncError, match="memory budget for A100"):
        plot_memory(sim, cluster, memory_gib={"a100-sxm4-80gb": 8})


def test_the_axis_scales_to_a_tight_budget_and_names_the_limits_above_it(sim, cluster):
    used = float(sim.tensor_peak_bytes.max() / GIB)
    fig = plot_memory(sim, cluster, memory_gib={"T4": used * 1.5})
    assert fig.layout.yaxis.range[1] == pytest.approx(1.15 * used * 1.5)
    assert [a.text for a in fig.layout.annotations] == ["limit 32 GiB ↑"]  # the V100's
    loose = plot_memory(sim, cluster)  # 16 and 32 GiB: both on the axis
    assert loose.layout.yaxis.range[1] == pytest.approx(1.15 * 32) and not loose.layout.annotations


def test_the_limit_is_the_budget_the_plan_was_made_under(graph, plan, cluster):
    from dataclasses import replace

    from qsync_lab.constraints import Constraints
    from qsync_lab.simulate import simulate

    budgeted = simulate(graph, replace(plan, constraints=Constraints({"T4": 2.5})))
    assert budgeted.memory_budget_bytes.tolist() == [cluster.device_of(0).memory_bytes,
                                                     2.5 * GIB]
    assert list(plot_memory(budgeted, cluster).data[-1].y) == [
        cluster.device_of(0).memory_bytes / GIB, 2.5]
