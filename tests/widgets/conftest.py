"""Fixtures of the widget tests: one small study (digits_cnn on local-hybrid), a tuner on it,
a tab's figure shown, and the timeline's bars next to the simulator's events."""

import pytest

from qsync_lab import Study
from qsync_lab.viz.common import selected_ranks
from qsync_lab.widgets import TABS, PlanTuner


@pytest.fixture(scope="session")
def study():
    return Study("digits_cnn", cluster="local-hybrid", progress=False)


@pytest.fixture
def tuner(study, tmp_path):
    return PlanTuner(study, root=tmp_path)


def shown(tuner, name: str):
    """The figure widget of tab ``name`` (:data:`~qsync_lab.widgets.TABS`), that tab shown."""
    tuner.tabs.selected_index = list(TABS).index(name)
    return tuner.figures[name]


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
