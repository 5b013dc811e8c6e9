"""``plot_timeline`` draws bars on a numeric µs axis and never shows the figure."""

import pytest
from tests.simulate.conftest import FAST, SLOW

from qsync_lab.errors import QSyncError
from qsync_lab.simulate import simulate
from qsync_lab.viz import plot_timeline


def test_bars_match_events(graph, make_cluster, round_costs):
    sim = simulate(graph, {SLOW: {"2": "fp16"}}, make_cluster([FAST, SLOW]), round_costs)
    fig = plot_timeline(sim, color_by="category")
    assert fig.layout.xaxis.type == "linear"
    traces = [t for t in fig.data if t.name != "idle"]  # idle: tests/viz/test_timeline.py
    assert {t.name for t in traces} == {"op", "cast", "ddp", "allreduce", "optimizer"}
    assert all(t.orientation == "h" for t in fig.data)
    bars = sum(len(t.x) for t in traces)
    assert bars == len(sim.events)
    rows = {y for t in traces for y in t.y}
    assert rows == {"rank 0 (V100-SXM2-32GB) compute", "rank 0 (V100-SXM2-32GB) comm",
                    "rank 1 (T4) compute", "rank 1 (T4) comm"}
    cast = next(t for t in fig.data if t.name == "cast")
    events = sim.events.query("category == 'cast'")
    assert list(cast.base) == pytest.approx(events["start_us"].tolist())
    assert list(cast.x) == pytest.approx(events["dur_us"].tolist())


def test_rank_selection_and_bad_arguments(graph, make_cluster, round_costs):
    sim = simulate(graph, {}, make_cluster([FAST, FAST, SLOW]), round_costs)
    default_rows = {y for t in plot_timeline(sim).data for y in t.y}
    assert {r.split(" ")[1] for r in default_rows} == {"0", "2"}  # one rank per class
    with pytest.raises(QSyncError, match="cannot colour by"):
        plot_timeline(sim, color_by="colour")
    with pytest.raises(QSyncError, match="rank 7 is out of range"):
        plot_timeline(sim, ranks=[7])
