"""The hook's telemetry times: a collective inside an encode or decode counts as
communication, and CUDA buckets are timed with events read only when the telemetry is
(checked here with a fake CUDA clock; on a GPU in test_hook_cuda.py)."""

import pytest
import torch
from torch import nn

from qsync_lab.compress import hook
from qsync_lab.compress.hook import CompressionState, StandaloneBucket, compression_hook
from qsync_lab.profile.compression import _one_rank_group
from qsync_lab.timers import CudaEventTimer
from tests.fake_cuda import MS_PER_RECORD

MS = 1_000_000  # ns


@pytest.fixture
def one_rank():
    with _one_rank_group():  # the compressors' profiler's one-rank gloo group
        yield


def _state(spec: str) -> tuple[CompressionState, nn.Parameter]:
    """A hook state for one 4 x 1024 weight, and the weight."""
    model = nn.Module()
    model.weight = nn.Parameter(torch.empty(4, 1024))
    return CompressionState(model, f"{spec},min_numel=0", telemetry=False), model.weight


def test_a_collective_inside_an_encode_or_decode_counts_as_communication(one_rank):
    state, _ = _state("global_qsgd:8")
    # host-clock marks in ns: encode 0-10 ms with a 3 ms scale sync inside it, decode
    # 10-20 ms with a 1 ms collective inside it, then the residual kept (2 ms, encode's)
    state._count("global_qsgd", 4096, 8 * 4096.0, torch.device("cpu"),
                 [("encode", [(0, 10 * MS)]), ("comm", [(2 * MS, 5 * MS)]),
                  ("decode", [(10 * MS, 20 * MS)]), ("comm", [(12 * MS, 13 * MS)]),
                  ("encode", [(20 * MS, 22 * MS)])])
    state._count("fp32", 16, 512.0, torch.device("cpu"), [("comm", [(0, 4 * MS)])])
    times = {method: (t["encode_ms"], t["comm_ms"], t["decode_ms"])
             for method, t in state.telemetry().items()}
    assert times == {"global_qsgd": (9.0, 4.0, 9.0), "fp32": (0.0, 4.0, 0.0)}
    assert state.telemetry() == {}  # read and reset
    state.close()


def test_cuda_buckets_are_timed_with_events_read_only_with_the_telemetry(one_rank, fake_cuda,
                                                                         monkeypatch):
    monkeypatch.setattr(hook, "timer_for", lambda device: CudaEventTimer("cuda"))
    state, weight = _state("cgx:8")
    calls = 3
    for _ in range(calls):
        buffer = torch.randn(4096, generator=torch.Generator().manual_seed(0))
        compression_hook(state, StandaloneBucket(weight, buffer)).wait()
    # per call: the encode's and the decode's two events; nothing read on the host yet
    assert fake_cuda == ["record"] * 4 * calls
    stats = state.telemetry()["cgx"]
    assert fake_cuda.count("synchronize") == 1 and fake_cuda.count("elapsed") == 2 * calls
    # each part spans one record of the fake clock per call; one rank: no collective
    assert stats["encode_ms"] == stats["decode_ms"] == calls * MS_PER_RECORD
    assert stats["comm_ms"] == 0.0 and stats["elements"] == calls * 4096
    state.close()

