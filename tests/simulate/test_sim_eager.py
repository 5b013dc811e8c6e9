"""The eager stream: a GPU's host issues each op (its host time, a profile's ``host_us``)
and the device runs it (its time); the device starts an op once the host has started
issuing it and the device has finished the op before. Known answers on the 5-op MLP,
whose compute stream is 12 op events (5 forward, 7 backward)."""

import numpy as np
import pandas as pd
import pytest
from tests.simulate.conftest import FAST, FAST_US, profile_rows

from qsync_lab.costs import CostModel, write_profile
from qsync_lab.simulate import simulate
from qsync_lab.simulate.schedule import eager_starts

OP_EVENTS = 12


def test_three_ops_with_known_host_and_device_times():
    # the host issues op 0 and 1 slower than the device runs them: the device waits for
    # each; op 2 runs longer than the host takes: the host is done first
    start, end = eager_starts(np.array([5.0, 5.0, 30.0]), np.array([20.0, 20.0, 10.0]))
    assert start.tolist() == [0.0, 20.0, 40.0] and end == 70.0
    # a device slower than the host: back to back from the first issue
    start, end = eager_starts(np.array([30.0, 30.0, 30.0]), np.array([10.0, 10.0, 10.0]))
    assert start.tolist() == [0.0, 30.0, 60.0] and end == 90.0
    # the last op's host time outlasts the device: the step ends with the host
    assert eager_starts(np.array([1.0, 1.0]), np.array([1.0, 50.0]))[1] == 51.0
    # no host times, or the host running the ops itself (a CPU): back to back
    for host in (np.zeros(3), np.array([5.0, 5.0, 30.0])):
        start, end = eager_starts(np.array([5.0, 5.0, 30.0]), host)
        assert start.tolist() == [0.0, 5.0, 10.0] and end == 40.0


def _costs(graph, tmp_path, host_us, metadata=None) -> CostModel:
    rows = profile_rows(graph, {FAST: FAST_US}).assign(host_us=host_us)
    rows.loc[rows["phase"] == "cast", "host_us"] = float("nan")
    write_profile(tmp_path / "gpu.csv", rows, metadata)
    return CostModel.from_profiles(tmp_path / "gpu.csv", calibrate=False)


def _ops(sim):
    events = sim.rank_events(0).query("stream == 'compute'")
    return events[events["category"] == "op"], events.iloc[-1]


@pytest.mark.parametrize("host_us", [30.0, 5.0, float("nan")])
def test_the_slower_of_host_and_device_paces_the_step(graph, make_cluster, tmp_path, host_us):
    sim = simulate(graph, {}, make_cluster([FAST]), _costs(graph, tmp_path, host_us))
    ops, optimizer = _ops(sim)
    assert ops["dur_us"].tolist() == [FAST_US] * OP_EVENTS  # durations stay the device's
    pace = max(FAST_US, 0.0 if np.isnan(host_us) else host_us)
    assert ops["start_us"].tolist() == pytest.approx([pace * k for k in range(OP_EVENTS)])
    # the optimizer waits for the host to have issued the last op too
    assert optimizer["start_us"] == pytest.approx(pace * OP_EVENTS)
    assert sim.iteration_us == pytest.approx(pace * OP_EVENTS + optimizer["dur_us"])


def test_the_fitted_framework_costs_are_host_work(graph, make_cluster, tmp_path):
    """With host times the step overhead is host work before the first op, and the
    per-event overhead is added to each op's host time, not to its device time."""
    costs = _costs(graph, tmp_path, 30.0, {"device": FAST, "step_overhead_us": "250; r2=1",
                                           "event_overhead_us": "-2.5; r2=1"})
    sim = simulate(graph, {}, make_cluster([FAST]), costs)
    ops, optimizer = _ops(sim)
    assert ops["dur_us"].tolist() == [FAST_US] * OP_EVENTS
    assert ops["start_us"].tolist() == pytest.approx([250 + 27.5 * k for k in range(OP_EVENTS)])
    assert optimizer["start_us"] == pytest.approx(250 + 27.5 * OP_EVENTS)


def test_an_op_costed_at_the_floor_of_measured_ops_holds_its_casts(graph, make_cluster,
                                                                   tmp_path):
    """Measured ops are timed whole, casts included, and so is the least time they show:
    an unmeasured op costed at that floor gets no cast events of its own."""
    rows = profile_rows(graph, {FAST: FAST_US})
    fp16 = profile_rows(graph, {FAST: 150.0}, precision="fp16")
    fp16 = fp16[(fp16["op"] == "0") & (fp16["phase"] != "cast")]
    write_profile(tmp_path / "gpu.csv", pd.concat([rows, fp16]))
    costs = CostModel.from_profiles(tmp_path / "gpu.csv")
    sim = simulate(graph, {FAST: {"2": "fp16"}}, make_cluster([FAST]), costs)
    op2 = sim.rank_events(0).query("fqn == '2'")
    assert set(op2["category"]) == {"op"}
    assert set(op2["source"]) == {"floor:profile:gpu.csv"}
    assert op2["dur_us"].tolist() == pytest.approx([150.0] * 3)
