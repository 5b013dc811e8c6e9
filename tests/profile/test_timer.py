"""Timers chosen by device: host-clock spans on the CPU, CUDA events resolved once per step
on a GPU (checked here with a fake event class), GPU names mapped to catalog kinds, and a
real-GPU profile (``--gpu``)."""

import itertools
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from qsync_lab.costs import PROFILE_COLUMNS, load_cost_model, read_profile
from qsync_lab.devices import load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.profile import ProfileJob, in_step, profile_machine
from qsync_lab.profile.machine import SINGLE_GPU_NOTE
from qsync_lab.profile.device import gpu_kind, profile_device, profile_device_name
from qsync_lab import timers
from qsync_lab.profile.timing import median_time_us
from qsync_lab.timers import CudaEventTimer, HostTimer, timer_for
from tests.fake_cuda import FakeEvent

GIB = 2**30


def test_the_timer_follows_the_device():
    assert type(timer_for("cpu")) is HostTimer
    assert type(timer_for(torch.device("cpu"))) is HostTimer
    assert type(timer_for("cuda")) is CudaEventTimer
    assert timer_for("cuda:1").device == torch.device("cuda", 1)


def test_the_host_timer_is_two_clock_reads_per_span(monkeypatch):
    ticks = iter([0, 1_000, 5_000, 7_000, 10_000, 13_000])
    monkeypatch.setattr(timers.time, "perf_counter_ns", lambda: next(ticks))
    # three repeats of 1, 2 and 3 µs: the median, in µs, as perf_counter_ns gave them
    assert median_time_us(lambda: None, repeats=3, warmup=0) == 2.0
    timer = HostTimer()
    timer.add("a", 10, 15)
    timer.add("a", 20, 30)
    timer.add("b", 0, 1)
    assert timer.totals_ns() == {"a": 15, "b": 1}


def test_cuda_spans_are_read_once_after_one_synchronise(fake_cuda):
    timer = CudaEventTimer("cuda")
    marks = [timer.mark() for _ in range(4)]  # the fake clock: 0, 1, 2, 3 ms
    timer.add("x", marks[0], marks[1])
    timer.add("y", marks[1], marks[2])
    timer.add("x", marks[2], marks[3])
    assert fake_cuda == ["record"] * 4  # nothing is read while the work runs
    totals = timer.totals_ns()
    assert fake_cuda == ["record"] * 4 + ["synchronize"] + ["elapsed"] * 3
    assert totals == {"x": 2e6, "y": 1e6}


def test_cuda_spans_can_be_taken_off_and_many_unread_ones_are_folded_as_they_complete(
        fake_cuda):
    timer = CudaEventTimer("cuda", pending_limit=3)
    marks = [timer.mark() for _ in range(6)]  # the fake clock: 0 ... 5 ms
    timer.add("encode", marks[0], marks[3])
    timer.add("encode", marks[1], marks[2], sign=-1)  # a collective inside the encode
    timer.add("comm", marks[1], marks[2])
    FakeEvent.complete_until(3.0)  # the device has run the first four events
    timer.add("decode", marks[4], marks[5])  # over the limit: the complete spans are read
    assert fake_cuda == ["record"] * 6 + ["elapsed"] * 3 and len(timer._spans) == 1
    assert timer.totals_ns() == {"encode": 2e6, "comm": 1e6, "decode": 1e6}
    assert fake_cuda[-2:] == ["synchronize", "elapsed"]


def test_unread_spans_that_do_not_complete_are_queried_in_doubling_rounds(fake_cuda,
                                                                          monkeypatch):
    queries = []
    monkeypatch.setattr(FakeEvent, "query", lambda event: queries.append(event) or False)
    timer = CudaEventTimer("cuda", pending_limit=4)
    for _ in range(40):  # a held stream: nothing completes
        begin = timer.mark()
        timer.add("x", begin, timer.mark())
    assert len(queries) == 5 + 11 + 23  # rounds past 4, 10 and 22 spans, not one per add


def test_in_step_timing_with_cuda_events_syncs_once_per_step(fake_cuda, monkeypatch):
    """The in-step bookkeeping with CUDA events (ops run on the CPU, timed by the fake
    clock): each op's call is one 1 ms span, each autograd node it created another."""
    monkeypatch.setattr(in_step, "timer_for", lambda device: CudaEventTimer("cuda"))
    monkeypatch.setattr(in_step, "hold_stream", lambda device, us: None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    steps, warmup = 2, 1
    t = in_step.time_ops_in_steps(model, (torch.randn(4, 8),), torch.tensor([0, 1, 2, 0]),
                                  nn.CrossEntropyLoss(), "fp32", steps=steps, warmup=warmup)
    # per step: its events recorded, one synchronise, then its spans read
    assert re.fullmatch(r"(record )+synchronize (elapsed )+" * (steps + warmup),
                        " ".join(fake_cuda) + " ")
    assert t.forward_us.tolist() == [1000.0] * 4  # 3 layers and the loss, 1 ms each
    assert all(us > 0 and us % 1000 == 0 for us in t.backward_us)  # whole nodes, per op
    elapsed_per_step = fake_cuda.count("elapsed") // (steps + warmup)
    assert elapsed_per_step == len(t.forward_us) + sum(t.backward_us) / 1000


def test_cuda_spans_also_time_the_host_and_are_held_as_long_as_it_took(fake_cuda,
                                                                       monkeypatch):
    """On CUDA each span also reads the host clock inside its two events (the host's time
    issuing the op, ``*_host_us``), and before its first event the stream is held for
    twice the host time the same span took in the first, unheld step, plus the slack."""
    monkeypatch.setattr(in_step, "timer_for", lambda device: CudaEventTimer("cuda"))
    holds = []
    monkeypatch.setattr(in_step, "hold_stream", lambda device, us: holds.append(us))
    clock = itertools.count(step=3_000)  # each host clock read: 3 µs later
    monkeypatch.setattr(timers.time, "perf_counter_ns", lambda: next(clock))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    t = in_step.time_ops_in_steps(model, (torch.randn(4, 8),), torch.tensor([0, 1, 2, 0]),
                                  nn.CrossEntropyLoss(), "fp32", steps=2, warmup=1)
    assert t.forward_host_us.tolist() == [3.0] * 4  # two reads, one tick apart
    assert all(us > 0 and us % 3 == 0 for us in t.backward_host_us)
    # the first step unheld, the two after it held by its host times
    assert holds == [in_step.HOLD_FACTOR * 3.0 + in_step.HOLD_SLACK_US] * len(holds)
    assert len(holds) % 2 == 0 and holds


def test_a_span_that_waits_for_its_hold_does_not_grow_the_next_hold(fake_cuda, monkeypatch):
    """A span whose host time includes waiting for the held stream (a value read back)
    sizes no later hold: every hold comes from the unheld first step."""
    monkeypatch.setattr(in_step, "timer_for", lambda device: CudaEventTimer("cuda"))
    holds, now, pending = [], [0], []

    def hold(device, us):
        holds.append(us)
        pending[:] = [int(us * 1e3), "begin"]

    def perf_counter_ns():  # 3 µs a read; a span's end read also waits out its hold
        now[0] += 3_000
        if pending and pending[1] == "end":
            now[0] += pending.pop(0)
            pending.clear()
        elif pending:
            pending[1] = "end"
        return now[0]

    monkeypatch.setattr(in_step, "hold_stream", hold)
    monkeypatch.setattr(timers.time, "perf_counter_ns", perf_counter_ns)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    in_step.time_ops_in_steps(model, (torch.randn(4, 8),), torch.tensor([0, 1, 2, 0]),
                              nn.CrossEntropyLoss(), "fp32", steps=4, warmup=1)
    assert max(holds) == min(holds)  # no growth from step to step


def test_the_host_waits_for_the_device_between_spans_never_inside_one(fake_cuda,
                                                                       monkeypatch):
    """The holds put the device behind the host; a full launch queue would make a span's
    host time wait for the device. So every DRAIN_SPANS spans the host synchronises, with
    no span open: between a span's two events there is never a synchronise."""
    monkeypatch.setattr(in_step, "timer_for", lambda device: CudaEventTimer("cuda"))
    monkeypatch.setattr(in_step, "hold_stream", lambda device, us: None)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(20)])
    steps, warmup = 2, 1
    in_step.time_ops_in_steps(model, (torch.randn(4, 8),), torch.randn(4, 8), nn.MSELoss(),
                              "fp32", steps=steps, warmup=warmup)
    per_step = [part for part in re.split(r"(?: elapsed)+ ?", " ".join(fake_cuda)) if part]
    assert len(per_step) == steps + warmup
    for step in per_step:
        spans = step.count("record") // 2
        assert spans > 3 * in_step.DRAIN_SPANS
        between = step.split(" synchronize")[:-1]  # the last one ends the step
        assert len(between) - 1 == (spans - 1) // in_step.DRAIN_SPANS
        records = [part.count("record") for part in between]
        assert all(n % 2 == 0 for n in records)  # each falls between two spans
        assert max(records) == 2 * in_step.DRAIN_SPANS


def test_gpu_names_map_to_catalog_kinds():
    catalog = load_catalog()
    h100 = dict(memory_bytes=85_520_809_984, compute_capability=(9, 0))
    assert gpu_kind(catalog, "NVIDIA H100 80GB HBM3", **h100) == "H100-SXM5-80GB"
    assert gpu_kind(catalog, "NVIDIA H100 PCIe", **h100) is None  # another form factor
    assert gpu_kind(catalog, "NVIDIA H100 80GB HBM3", memory_bytes=h100["memory_bytes"],
                    compute_capability=(8, 0)) is None
    assert gpu_kind(catalog, "Tesla V100-SXM2-32GB", memory_bytes=int(31.7 * GIB),
                    compute_capability=(7, 0)) == "V100-SXM2-32GB"
    assert gpu_kind(catalog, "Tesla T4", memory_bytes=int(14.6 * GIB),
                    compute_capability=(7, 5)) == "T4"
    assert gpu_kind(catalog, "NVIDIA A10", memory_bytes=22 * GIB,
                    compute_capability=(8, 6)) == "A10"
    assert gpu_kind(catalog, "NVIDIA A100 80GB PCIe", memory_bytes=int(79.2 * GIB),
                    compute_capability=(8, 0)) is None


def test_the_rows_name_the_gpus_catalog_kind_else_its_own_name(monkeypatch):
    gpus = {"H100": SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85_520_809_984,
                                    major=9, minor=0),
            "new": SimpleNamespace(name="NVIDIA Z9 Ultra", total_memory=200 * GIB, major=12,
                                   minor=0)}
    for key, expected in (("H100", "H100-SXM5-80GB"), ("new", "NVIDIA Z9 Ultra")):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, g=gpus[key]: g)
        assert profile_device_name("cuda") == expected
    assert profile_device_name("cpu") == "cpu"


def test_a_profile_runs_on_the_cpu_or_a_visible_gpu(monkeypatch):
    assert profile_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(QSyncError, match="no CUDA GPU"):
        profile_device("cuda")
    with pytest.raises(QSyncError, match="cannot profile on meta"):
        profile_device("meta")
    with pytest.raises(QSyncError, match="unknown profiling device"):
        profile_device("gpu0")


@pytest.mark.gpu
def test_a_gpu_profile_has_every_precision_and_phase(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 64))
    job = ProfileJob("mlp", model, (torch.randn(64, 256),), torch.randint(0, 64, (64,)),
                     nn.CrossEntropyLoss())
    precisions = ["fp32", "bf16", "fp16", "int8"]
    out = tmp_path / "gpu.csv"
    written = profile_machine([job], out, precisions=precisions, repeats=3, progress=False,
                              compression=["fp16", "cgx:8"], device="cuda")
    table = read_profile(out)
    rows, name = table.frame, profile_device_name("cuda")
    assert list(rows.columns) == list(PROFILE_COLUMNS) and set(rows["device"]) == {name}
    assert table.metadata["device"] == name and table.metadata["skipped"] == SINGLE_GPU_NOTE
    assert written.link == SINGLE_GPU_NOTE
    compressed = rows[rows["phase"] == "compress"]  # the hook's CUDA kernels, per size
    assert set(compressed["op"]) == {"fp16", "cgx:8"} and (compressed["time_us"] > 0).all()
    ops = rows[~rows["phase"].isin(["cast", "compress"])]
    for precision in precisions:
        mine = ops[ops["plan_precision"] == precision]
        assert set(mine["phase"]) == {"forward", "backward_input", "backward_weight"}
        assert (mine["time_us"] > 0).all()
    assert (ops["host_us"] > 0).all()  # the host's time issuing each op
    assert rows.loc[rows["phase"] == "cast", "host_us"].isna().all()
    assert (rows.loc[rows["phase"] == "cast", "time_us"] > 0).all()
    if name in load_catalog().devices:  # the cost model attributes the rows to that kind
        costs, device = load_cost_model(out), load_catalog().device(name)
        assert costs.profiles[0].op_time_us(name, "0", "bf16", "forward", 64) > 0
        encode = costs.compression_time_us("cgx:8", "encode", 2**22, 9.0, device)
        assert encode.source.startswith("fit:") and encode.us > 0
