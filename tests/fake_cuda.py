"""A fake CUDA clock for testing event timers on the CPU: torch.cuda's events, current
stream and synchronise replaced, every call logged; the ``fake_cuda`` fixture (a plugin
of ``tests/conftest.py``)."""

import itertools

import pytest
import torch

MS_PER_RECORD = 1.0  # the fake GPU clock advances this much at each recorded event


class FakeEvent:
    """A CUDA event on a fake clock that logs its records and reads; an event has completed
    once the device was synchronised after it was recorded (or ``complete_until`` says so),
    and reading an event that has not is an error, as on a GPU."""

    log: list = []
    clock = itertools.count()
    done_ms = -1.0  # events recorded at or before this time have completed
    last_ms = -1.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.ms = None

    def record(self, stream=None) -> None:
        assert stream == "stream"
        self.ms = type(self).last_ms = next(self.clock) * MS_PER_RECORD
        self.log.append("record")

    def query(self) -> bool:
        return self.ms <= self.done_ms

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.query() and end.query(), "elapsed_time of an event not yet completed"
        self.log.append("elapsed")
        return end.ms - self.ms

    @classmethod
    def complete_until(cls, ms: float) -> None:
        """The device has run the work recorded up to ``ms``."""
        cls.done_ms = ms


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's events, stream and synchronise replaced by fakes; the call log."""
    log = []

    def synchronize(device=None):
        log.append("synchronize")
        FakeEvent.done_ms = FakeEvent.last_ms

    monkeypatch.setattr(FakeEvent, "log", log)
    monkeypatch.setattr(FakeEvent, "clock", itertools.count())
    monkeypatch.setattr(FakeEvent, "done_ms", -1.0)
    monkeypatch.setattr(FakeEvent, "last_ms", -1.0)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    return log
