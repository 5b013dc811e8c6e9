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
