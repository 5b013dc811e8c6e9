"""``plot_timeline``: bars coloured by precision from the shared mapping, casts and
compressed allreduces hatched, and the compute streams' idle gaps drawn."""

import numpy as np
import pytest

from qsync_lab.precision import Precision
from qsync_lab.simulate import simulate
from qsync_lab.viz import PRECISION_COLORS, plot_timeline


def test_every_precision_has_its_own_colour():
    assert set(PRECISION_COLORS) == {str(p) for p in Precision}
    assert len(set(PRECISION_COLORS.values())) == len(PRECISION_COLORS)


def test_bars_take_their_precisions_colour_and_casts_are_hatched(sim):
    fig = plot_timeline(sim, ranks=[0, 1])
    bars = [t for t in fig.data if t.name != "idle"]
    assert {t.name for t in bars} == {"fp32", "fp16", "int8"}
    for trace in bars:
        assert trace.marker.color == PRECISION_COLORS[trace.name]
        events = sim.events[sim.events["precision"] == trace.name]
        assert list(trace.base) == pytest.approx(events["start_us"].tolist())
        expected = ["/" if c == "cast" else "" for c in events["category"]]
        assert list(trace.marker.pattern.shape) == expected
    assert any("/" in t.marker.pattern.shape for t in bars)  # casts exist, hatched


def test_other_colourings_use_the_default_colours(sim):
    assert all(t.marker.color is None for t in plot_timeline(sim, color_by="category").data
               if t.name != "idle")


def test_compressed_allreduces_are_hatched(graph, cluster):
    sim = simulate(graph, {}, cluster, compression="global_qsgd:8,min_numel=16")
    comm = [t for t in plot_timeline(sim, color_by="category").data if t.name == "compressed"]
    assert len(comm) == 1 and set(comm[0].marker.pattern.shape) == {"x"}
    assert len(comm[0].x) == (sim.events["category"] == "compressed").sum()


def test_idle_gaps_add_up_to_the_simulators_idle_time_between_the_events(sim):
    fig = plot_timeline(sim, ranks=[0, 1])
    idle = next(t for t in fig.data if t.name == "idle")
    rows = np.array(idle.y)
    assert set(rows) == {"rank 0 (V100-SXM2-32GB) compute", "rank 1 (T4) compute"}
    for rank in (0, 1):
        mine = rows == f"rank {rank} ({sim.rank_devices[rank]}) compute"
        start, dur = np.array(idle.base)[mine], np.array(idle.x)[mine]
        assert dur.sum() == pytest.approx(sim.idle_us[rank], rel=1e-6)
        events = sim.rank_events(rank).query("stream == 'compute'")
        for a, b in zip(start, start + dur):  # no gap overlaps an event
            assert not np.any((events["start_us"] < b - 1e-9)
                              & (events["start_us"] + events["dur_us"] > a + 1e-9))


def test_every_legend_entry_has_a_name():
    """DDP's buffer broadcast (a BatchNorm model) has no precision: its bars are named by
    their category, not left as an unnamed first legend entry."""
    from qsync_lab import Study

    study = Study("digits_cnn", cluster="local-hybrid", progress=False)
    fig = plot_timeline(study.simulate(study.plan()))
    names = [trace.name for trace in fig.data]
    assert all(names) and "broadcast" in names, names
    assert fig.layout.legend.orientation == "h"  # one row under the axis, never scrolled
