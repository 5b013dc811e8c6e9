"""Fixtures of the widget tests: one small study (digits_cnn on local-hybrid), a tuner on it,
and the timeline's bars next to the simulator's events."""

import pytest

from qsync_lab import Study
from qsync_lab.viz.common import selected_ranks
from qsync_lab.widgets import PlanTuner


@pytest.fixture(scope="session")
def study():
    return Study("digits_cnn", cluster="local-hybrid", progress=False)


@pytest.fixture
def tuner(study, tmp_path):
    return PlanTuner(study, root=tmp_path)


def timeline_bars(figure) -> list[tuple[str, float, float]]:
    """(row, start µs, duration µs) of every bar of a timeline figure but the idle ones."""
    return sorted((row, base, dur) for trace in figure.data if trace.name != "idle"
                  for row, base, dur in zip(trace.y, trace.base, trace.x))


def simulated_bars(sim) -> list[tuple[str, float, float]]:
    """(row, start µs, duration µs) of the events of the ranks a timeline draws."""
    bars = []
    for rank in selected_ranks(sim, None):
        events = sim.rank_events(rank)
        bars += [(f"rank {rank} ({sim.rank_devices[rank]}) {stream}", start, dur)
                 for stream, start, dur in zip(events["stream"], events["start_us"],
                                               events["dur_us"])]
    return sorted(bars)
