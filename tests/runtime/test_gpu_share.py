"""Several ranks on one GPU: the backend choice, the MPS daemon's life and the refusals,
checked on the CPU with a stand-in ``nvidia-cuda-mps-control`` (a script that records its
calls and creates or removes the control pipe as the real daemon does)."""

import os
import shutil
import stat

import pytest

from qsync_lab.errors import QSyncError
from qsync_lab.runtime.gpu_share import (MPS_CONTROL, backend_for, enter_sm_partition,
                                         mps_daemon, mps_running, shared_gpus)

_FAKE = """#!/bin/sh
echo "$@" >> "{log}"
if [ "$1" = "-d" ]; then {start}; else read line; echo "stdin $line" >> "{log}"; rm -f "{pipe}/control"; fi
"""


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    """A fake control binary on PATH and a private pipe directory; returns the call log."""
    pipe, log, bin_dir = tmp_path / "pipe", tmp_path / "calls.log", tmp_path / "bin"
    pipe.mkdir()
    bin_dir.mkdir()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def install(starts=True):
        start = f'touch "{pipe}/control"' if starts else 'echo "not root" >&2; exit 1'
        script = bin_dir / MPS_CONTROL
        script.write_text(_FAKE.format(log=log, pipe=pipe, start=start))
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        return log
    return install


def test_ranks_that_share_a_gpu_talk_over_gloo():
    assert shared_gpus([0, 1, 1, 0]) == [0, 1]
    assert backend_for([0, 1], cuda=True) == "nccl"
    assert backend_for([0, 0], cuda=True) == "gloo"
    assert backend_for([0, 1], cuda=False) == "gloo"


def test_mps_is_started_for_the_run_and_stopped_after_it(fake_mps):
    log = fake_mps()
    with mps_daemon([0]) as what:
        assert what == "started" and mps_running()
    assert not mps_running()
    assert log.read_text().splitlines() == ["-d", "", "stdin quit"]


def test_a_running_daemon_is_used_and_left_running(fake_mps, tmp_path):
    log = fake_mps()
    (tmp_path / "pipe" / "control").touch()
    with mps_daemon([0]) as what:
        assert what == "already running"
    assert mps_running() and not log.exists()


def test_a_daemon_started_for_a_failed_run_is_stopped_too(fake_mps):
    fake_mps()
    with pytest.raises(RuntimeError, match="rank died"):
        with mps_daemon([0]):
            raise RuntimeError("rank died")
    assert not mps_running()


def test_no_gpu_shared_needs_no_daemon(fake_mps):
    log = fake_mps()
    with mps_daemon([]) as what:
        assert what == "not needed"
    assert not log.exists()


def test_mps_that_cannot_start_is_refused_in_one_line(fake_mps):
    fake_mps(starts=False)
    with pytest.raises(QSyncError, match=r"could not start MPS .*GPU 0 \(not root\)"):
        with mps_daemon([0]):
            pass


def test_missing_mps_is_refused_in_one_line(fake_mps):
    if shutil.which(MPS_CONTROL):
        pytest.skip("this machine has MPS")
    with pytest.raises(QSyncError, match=f"share GPU 0, 1.*{MPS_CONTROL} is not on PATH"):
        with mps_daemon([0, 1]):
            pass


def test_a_partition_without_a_gpu_is_refused_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(QSyncError, match="cannot make a green context of 16 SMs on GPU 0"):
        enter_sm_partition(16, 0)
