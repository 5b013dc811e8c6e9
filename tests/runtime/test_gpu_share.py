"""Several ranks on one GPU: the backend choice, the MPS daemon's life and the refusals,
checked on the CPU with a stand-in ``nvidia-cuda-mps-control`` (a script that records its
calls and creates or removes the control pipe as the real daemon does), and the carving of a
GPU's SMs into disjoint shares with a stand-in driver (its splits take the first SMs left,
as every process's do alike)."""

import os
import stat
from types import SimpleNamespace

import pytest

from qsync_lab.errors import QSyncError
from qsync_lab.runtime.gpu_share import (MPS_CONTROL, MPS_ENV, _carve, backend_for,
                                         enter_sm_partition, mps_control, mps_daemon,
                                         mps_running, shared_gpus)

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
    with pytest.raises(QSyncError, match=r"could not start MPS .*GPU 0 \(not root; its log"):
        with mps_daemon([0]):
            pass


def test_mps_off_lets_the_ranks_take_turns(fake_mps, monkeypatch):
    log = fake_mps()
    monkeypatch.setenv(MPS_ENV, "off")
    with mps_daemon([0]) as what:
        assert what == "off" and not mps_running()
    assert not log.exists()


def test_missing_mps_is_refused_in_one_line(fake_mps):
    if mps_control():
        pytest.skip("this machine has MPS")
    with pytest.raises(QSyncError, match=f"share GPU 0, 1.*{MPS_CONTROL} is not on PATH"):
        with mps_daemon([0, 1]):
            pass


def test_a_partition_without_a_gpu_is_refused_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(QSyncError, match="cannot make a green context of 16 SMs on GPU 0"):
        enter_sm_partition([116, 16], 1, 0)


class _Driver:
    """A stand-in ``cuda.bindings.driver`` for a GPU of ``sms`` SMs: splits round up to 8 SMs
    and take the first ones left; a split's own outputs are refused as its input (as CUDA
    does) until a green context is made of them."""

    CUresult = SimpleNamespace(CUDA_SUCCESS=0)
    CUdevResourceType = SimpleNamespace(CU_DEV_RESOURCE_TYPE_SM="sm")
    CUgreenCtxCreate_flags = SimpleNamespace(CU_GREEN_CTX_DEFAULT_STREAM=1)
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)

    def __init__(self, sms):
        self.sms = sms

    @staticmethod
    def _resource(ids, split=False):
        return SimpleNamespace(ids=ids, split=split, sm=SimpleNamespace(smCount=len(ids)))

    def cuInit(self, flags):
        return (0,)

    def cuDeviceGet(self, index):
        return 0, f"gpu{index}"

    def cuDeviceGetDevResource(self, device, kind):
        return 0, self._resource(tuple(range(self.sms)))

    def cuDevSmResourceSplitByCount(self, groups, resource, flags, count):
        if resource.split:
            return (801,)  # CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, say
        count = -(-count // 8) * 8
        if count > len(resource.ids):
            return 0, [], 0, self._resource(resource.ids, True)
        return (0, [self._resource(resource.ids[:count], True)], 1,
                self._resource(resource.ids[count:], True))

    def cuDevResourceGenerateDesc(self, resources, count):
        return 0, resources[0].ids

    def cuGreenCtxCreate(self, desc, device, flags):
        return 0, SimpleNamespace(ids=desc)

    def cuGreenCtxGetDevResource(self, context, kind):
        return 0, self._resource(context.ids)

    def cuGreenCtxStreamCreate(self, context, flags, priority):
        return 0, 7


@pytest.mark.parametrize("shares, granted", [
    ([116, 16], [116, 16]),  # the benchmark's: the largest takes the 116 SMs left
    ([16, 16, 100], [16, 16, 100]),
    ([100, 20], [104, 24]),  # short of the GPU: each rounded up to 8 SMs
])
def test_the_shares_of_a_gpu_are_carved_apart(shares, granted):
    driver = _Driver(132)
    made = [_carve(driver, shares, position, 0) for position in range(len(shares))]
    assert [sms for _, _, sms in made] == granted
    ids = [set(context.ids) for context, _, _ in made]
    assert sum(map(len, ids)) == len(set().union(*ids))  # no SM in two shares
    assert all(stream == 7 for _, stream, _ in made)


def test_a_share_that_rounding_leaves_no_room_for_is_refused():
    # 41 and 44 SMs take 48 each: 36 are left for the second 44
    with pytest.raises(RuntimeError, match="no group of 44 SMs is left on GPU 0"):
        _carve(_Driver(132), [44, 44, 41], 1, 0)


@pytest.mark.parametrize("rank, position", [(0, 0), (1, 1)])
def test_a_rank_on_a_shared_gpu_enters_its_own_share(tmp_path, monkeypatch, rank, position):
    """The trainer's CUDA branch (no GPU needed): the rank's GPU and SMs come from the plan's
    cluster, and every rank on that GPU passes the same shares."""
    import torch

    from qsync_lab.runtime import rank_context
    from qsync_lab.runtime.options import TrainConfig
    from tests.runtime.conftest import cluster_file, write_plan

    groups = ['{ kind = "H100-SXM5-80GB", count = 1, sms = 116 }',
              '{ kind = "H100-SXM5-80GB", count = 1, sms = 16 }']
    plan = write_plan(tmp_path / "plan.json", cluster_file(tmp_path, groups), {})
    entered = []
    monkeypatch.setattr(rank_context.dist, "get_rank", lambda: rank)
    monkeypatch.setattr(rank_context.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(rank_context, "enter_sm_partition", lambda *call: entered.append(call))
    run = rank_context.RankContext(TrainConfig(str(plan), str(tmp_path / "run"), steps=1), None)
    assert run.device == torch.device("cuda", 0)
    assert entered == [([116, 16], position, 0)]
