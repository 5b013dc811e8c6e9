"""Chrome/Perfetto trace export."""

import json

import pytest
from tests.simulate.conftest import FAST, SLOW, assert_no_overlap

from qsync_lab.simulate import simulate


def test_trace_json_structure_units_and_round_trip(graph, make_cluster, round_costs, tmp_path):
    sim = simulate(graph, {SLOW: {"2": "fp16"}}, make_cluster([FAST, SLOW]), round_costs)
    path = tmp_path / "trace.json"
    sim.write_perfetto(path)
    trace = sim.to_perfetto()
    loaded = json.loads(path.read_text())
    assert loaded == trace
    assert loaded["displayTimeUnit"] == "ms"
    events = loaded["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    spans = [e for e in events if e["ph"] == "X"]
    names = {(e["pid"], e["tid"], e["name"]): e["args"].get("name") for e in meta}
    assert names[(1, 0, "process_name")] == "rank 1 (T4)"
    assert names[(0, 1, "thread_name")] == "comm"
    assert {e["pid"] for e in spans} == {0, 1} and {e["tid"] for e in spans} == {0, 1}
    assert len(spans) == len(sim.events)
    for e in spans:
        assert set(e) == {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
        assert set(e["args"]) == {"fqn", "precision", "plan_precision", "phase", "bytes",
                                  "source"}
    frame = sim.events
    assert [e["ts"] for e in spans] == pytest.approx(frame["start_us"].tolist())  # microseconds
    assert [e["dur"] for e in spans] == pytest.approx(frame["dur_us"].tolist())
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(sim.iteration_us)
    assert min(e["ts"] for e in spans) == 0
    assert_no_overlap(frame)


def test_trace_of_selected_ranks(graph, make_cluster, round_costs):
    sim = simulate(graph, {}, make_cluster([FAST, SLOW]), round_costs)
    trace = sim.to_perfetto(ranks=[1])
    assert {e["pid"] for e in trace["traceEvents"]} == {1}
