"""The step-overhead calibration: a disturbed fit (low R²) is measured again."""

import pytest

from qsync_lab.errors import QSyncError
from qsync_lab.profile import LineFit, overhead
from qsync_lab.profile.overhead import fit_step_overhead


def _fits(monkeypatch, r2s):
    """Make each calibration return the next of ``r2s``; return the list of calls made."""
    calls = []

    def fake(*args):
        calls.append(args)
        return LineFit(2.0, 20.0, r2s[len(calls) - 1], 4)

    monkeypatch.setattr(overhead, "_fit_once", fake)
    return calls


def test_a_disturbed_fit_is_measured_again(monkeypatch):
    calls = _fits(monkeypatch, [0.50, 0.995, 0.2])
    assert fit_step_overhead().r2 == 0.995
    assert len(calls) == 2  # stops at the first good one


def test_a_good_first_fit_is_kept(monkeypatch):
    calls = _fits(monkeypatch, [0.97])
    assert fit_step_overhead().r2 == 0.97 and len(calls) == 1


def test_the_best_of_all_attempts_when_none_is_good(monkeypatch):
    calls = _fits(monkeypatch, [0.3, 0.8, 0.6])
    assert fit_step_overhead(attempts=3).r2 == 0.8 and len(calls) == 3


def test_attempts_must_be_positive():
    with pytest.raises(QSyncError, match="attempts must be at least 1"):
        fit_step_overhead(attempts=0)


def test_a_real_calibration_is_a_line_through_the_residuals():
    fit = fit_step_overhead(depths=(1, 4), width=8, repeats=3, warmup=1, attempts=1)
    assert fit.samples == 2 and fit.r2 == pytest.approx(1.0)  # two points: an exact line
