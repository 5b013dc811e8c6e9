"""A profile runs its work with the threads one rank will have: the hook's sender thread in
the profiling process, and the Numba pools of the ranks it spawns."""

import os

import numba
import pytest

from qsync_lab.compress.hook import CompressionState
from qsync_lab.profile import intra_op_threads, profile_compression
from qsync_lab.profile.timing import spawned_numba_threads


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs a Numba pool of 2+")
def test_the_compressors_are_timed_with_the_callers_numba_threads(monkeypatch):
    seen = []
    reduce_group = CompressionState._reduce_group

    def spy(self, buffer, group):  # runs on the hook's sender thread
        seen.append(numba.get_num_threads())
        return reduce_group(self, buffer, group)

    monkeypatch.setattr(CompressionState, "_reduce_group", spy)
    with intra_op_threads(1):
        rows = profile_compression(["cgx:4"], [4096], repeats=1, warmup=0)
    assert seen == [1]  # a new thread would get the whole pool
    assert (rows["time_us"] > 0).all()


@pytest.mark.parametrize("before", [None, "7"])
def test_spawned_ranks_get_the_threads_in_their_environment(monkeypatch, before):
    if before is None:
        monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("NUMBA_NUM_THREADS", before)
    with spawned_numba_threads(1):
        assert os.environ["NUMBA_NUM_THREADS"] == "1"
    assert os.environ.get("NUMBA_NUM_THREADS") == before


def test_the_calibration_ranks_are_spawned_with_a_numba_pool_of_their_threads(monkeypatch):
    from qsync_lab.profile import ddp_link

    seen = []

    def fake_start(worker, args, nprocs, start_method):  # records what a spawned rank inherits
        seen.append(os.environ.get("NUMBA_NUM_THREADS"))
        with open(args[2], "w") as f:  # the "out" file the ranks would write
            f.write("1.0 2.0")

    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    monkeypatch.setattr(ddp_link.mp, "start_processes", fake_start)
    assert ddp_link._run(64, 2, 2, 1, 4, 1, "ddp") == (1.0, 2.0)
    assert seen == ["1"]
    assert "NUMBA_NUM_THREADS" not in os.environ
