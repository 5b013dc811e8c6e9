"""A user model's own step overhead: its measured training step beyond its op rows."""

import os
import threading

import pandas as pd
import pytest
import torch
from torch import nn

from qsync_lab import optimizers
from qsync_lab.costs import CostModel, write_profile
from qsync_lab.errors import QSyncError
from qsync_lab.devices import load_catalog
from qsync_lab.precision import Precision
from qsync_lab.profile.concurrent import profile_ops_concurrently
from qsync_lab.profile.model_cache import profile_key
from qsync_lab.profile.overhead import (measured_step_overhead_metadata,
                                        model_step_overhead_metadata, time_training_step)
from qsync_lab.resources import data_file


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch():
    return (torch.randn(4, 8),), torch.tensor([0, 1, 2, 0])


def test_the_timed_step_runs_the_named_optimizer_on_a_copy(monkeypatch):
    made = []
    real = optimizers.make_optimizer
    monkeypatch.setattr(optimizers, "make_optimizer",
                        lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    inputs, target = _batch()
    step_us = time_training_step(model, inputs, target, nn.CrossEntropyLoss(), "adamw",
                                 repeats=3, warmup=1)
    assert step_us > 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # untouched
    (optimizer,) = made
    assert isinstance(optimizer, torch.optim.AdamW)
    assert all(optimizer.state[p]["step"] == 4 for p in optimizer.param_groups[0]["params"])


def test_a_non_finite_gradient_skips_the_timed_optimizer_step(monkeypatch):
    made = []
    real = optimizers.make_optimizer
    monkeypatch.setattr(optimizers, "make_optimizer",
                        lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    inputs, target = (torch.full((4, 8), float("nan")),), torch.tensor([0, 1, 2, 0])
    time_training_step(_mlp(), inputs, target, nn.CrossEntropyLoss(), "sgd_momentum",
                       repeats=2, warmup=0)
    assert not made[0].state  # never stepped: as the run skips or stops such a step


def test_the_step_overhead_is_the_step_beyond_its_rows_and_wins_over_the_shipped_one(tmp_path):
    metadata = model_step_overhead_metadata(1500.0, 1000.0, 120.0)
    rows = pd.DataFrame([{"device": "cpu", "op": "0", "kind": "linear", "shape_key": "x",
                          "precision": "fp32", "plan_precision": "fp32", "phase": "forward",
                          "batch_size": 4, "numel": 1, "flops": 1.0, "bytes": 1.0,
                          "time_us": 1000.0, "repeats": 3}])
    write_profile(tmp_path / "model.csv", rows, {"device": "cpu", **metadata})
    costs = CostModel.from_profiles(tmp_path / "model.csv", data_file("profiles", "cpu.csv"))
    assert costs.step_overhead_us["cpu"] == pytest.approx(380.0)
    assert costs.event_overhead_us["cpu"] == 0.0
    shipped = CostModel.from_profiles(data_file("profiles", "cpu.csv"))
    assert shipped.step_overhead_us["cpu"] != pytest.approx(380.0)


def test_the_cached_profile_carries_the_measured_step_overhead(tmp_path):
    rows = pd.DataFrame({"precision": ["fp32", "fp32", "bf16"], "time_us": [300.0, 500.0, 90.0]})
    rows.attrs["training_step_us"] = 2000.0
    model = _mlp()
    metadata = measured_step_overhead_metadata([rows], model, "sgd_momentum")
    params = 4.0 * sum(p.numel() for p in model.parameters())
    optimizer_us = CostModel.from_profiles(data_file("profiles", "cpu.csv")).optimizer_time_us(
        params, "sgd_momentum", load_catalog().device("cpu")).us
    residual = float(metadata["step_overhead_us"].split(";")[0])
    assert residual == pytest.approx(2000.0 - 800.0 - optimizer_us, abs=1e-3)


def test_the_ddp_steps_are_timed_under_each_uniform_plan(monkeypatch, tmp_path):
    from qsync_lab import quant
    from qsync_lab.profile.overhead import time_ddp_training_steps

    applied = []
    real = quant.apply_plan_
    monkeypatch.setattr(quant, "apply_plan_", lambda model, plan, **kw: applied.append(plan)
                        or real(model, plan, **kw))
    inputs, target = _batch()
    steps = time_ddp_training_steps(_mlp(), inputs, target, nn.CrossEntropyLoss(), "sgd",
                                    ["fp32", "int8"], store=str(tmp_path / "store"), rank=0,
                                    world_size=1, repeats=2, warmup=0)
    assert list(steps) == ["fp32", "int8"] and min(steps.values()) > 0
    assert applied == [{}, {"0": "int8", "2": "int8"}]


def test_calibrated_overheads_make_the_simulator_predict_the_measured_ddp_steps(tmp_path):
    from qsync_lab.cluster import cluster_from_definition
    from qsync_lab.costs import load_cost_model
    from qsync_lab.graph import trace_graph
    from qsync_lab.plan import Plan
    from qsync_lab.profile import profile_ops
    from qsync_lab.profile.overhead import ddp_calibrated_metadata
    from qsync_lab.simulate import simulate

    model, (inputs, target), loss_fn = _mlp(), _batch(), nn.CrossEntropyLoss()
    graph = trace_graph(model, inputs, target=target, loss_fn=loss_fn)
    rows = profile_ops(model, inputs, target, loss_fn, ["fp32", "bf16"], repeats=2, warmup=0,
                       progress=False)
    measured = {"fp32": 40_000.0, "bf16": 70_000.0}
    rows.attrs.update(ddp_step_us=measured, ddp_processes=3)
    metadata = ddp_calibrated_metadata([rows], graph, "sgd")
    assert "fp32 DDP step 40000.0 us on 3 processes" in metadata["step_overhead_us"]
    write_profile(tmp_path / "model.csv", rows, {"device": "cpu", **metadata})
    costs = load_cost_model(tmp_path / "model.csv", data_file("profiles", "cpu.csv"))
    assert costs.precision_op_overhead_us[("cpu", Precision.BF16)] > 0
    cluster = cluster_from_definition({"name": "three", "batch_size": 4, "node": [
        {"name": "n", "intra_node_link": "loopback", "devices": [{"kind": "cpu", "count": 3}]}]})
    for name, plan in {"fp32": {}, "bf16": {"0": "bf16", "2": "bf16"}}.items():
        sim = simulate(graph, Plan.build(graph, cluster, {"cpu": plan}), cluster, costs,
                       optimizer="sgd")
        assert sim.iteration_us == pytest.approx(measured[name]), name
    half = simulate(graph, Plan.build(graph, cluster, {"cpu": {"2": "bf16"}}), cluster, costs,
                    optimizer="sgd")
    assert measured["fp32"] < half.iteration_us < measured["bf16"]  # a mix lies between


def test_a_gpu_profile_is_calibrated_to_its_models_steps_on_one_rank(tmp_path):
    """A GPU's rows carry host times, and a host-bound step that they under-count (the
    framework's work around the ops) is predicted once calibrated to the measured steps."""
    from qsync_lab.cluster import cluster_from_definition
    from qsync_lab.costs import load_cost_model
    from qsync_lab.graph import trace_graph
    from qsync_lab.plan import Plan
    from qsync_lab.profile import profile_ops
    from qsync_lab.profile.overhead import ddp_calibrated_metadata
    from qsync_lab.simulate import simulate

    h100 = "H100-SXM5-80GB"
    model, (inputs, target), loss_fn = _mlp(), _batch(), nn.CrossEntropyLoss()
    graph = trace_graph(model, inputs, target=target, loss_fn=loss_fn)
    rows = profile_ops(model, inputs, target, loss_fn, ["fp32", "bf16"], repeats=2, warmup=0,
                       progress=False)
    rows = rows.assign(device=h100, host_us=3 * rows["time_us"] + 40.0)  # host-bound ops
    write_profile(tmp_path / "rows.csv", rows, {"device": h100})
    cluster = cluster_from_definition({"name": "one", "batch_size": 4, "node": [
        {"name": "n", "intra_node_link": "nvlink4", "devices": [{"kind": h100, "count": 1}]}]})
    plans = {name: Plan.build(graph, cluster, {h100: plan})
             for name, plan in {"fp32": {}, "bf16": {"0": "bf16", "2": "bf16"}}.items()}
    rows_only = {name: simulate(graph, plan, cluster, load_cost_model(tmp_path / "rows.csv"),
                                optimizer="sgd").iteration_us for name, plan in plans.items()}
    # beyond the rows: the same framework cost in both steps, and more in bf16's
    measured = {"fp32": 2 * rows_only["fp32"],
                "bf16": 2 * rows_only["bf16"] + rows_only["fp32"]}
    rows.attrs.update(ddp_step_us=measured, ddp_processes=1)
    metadata = ddp_calibrated_metadata([rows], graph, "sgd")
    assert "on 1 processes - its simulation" in metadata["step_overhead_us"]
    write_profile(tmp_path / "gpu.csv", rows, {"device": h100, **metadata})
    costs = load_cost_model(tmp_path / "gpu.csv", data_file("profiles", "cpu.csv"))
    for name, plan in plans.items():
        sim = simulate(graph, plan, cluster, costs, optimizer="sgd")
        assert sim.iteration_us == pytest.approx(measured[name], rel=1e-6), name


def test_a_precision_the_device_kind_cannot_plan_is_left_uncalibrated():
    from qsync_lab.graph import trace_graph
    from qsync_lab.profile import profile_ops
    from qsync_lab.profile.overhead import ddp_calibrated_metadata

    model, (inputs, target), loss_fn = _mlp(), _batch(), nn.CrossEntropyLoss()
    graph = trace_graph(model, inputs, target=target, loss_fn=loss_fn)
    rows = profile_ops(model, inputs, target, loss_fn, ["fp32", "fp16", "fp8_e5m2"], repeats=2,
                       warmup=0, progress=False).assign(device="H100-SXM5-80GB")
    rows.attrs.update(ddp_step_us={"fp32": 9e3, "fp16": 8e3, "fp8_e5m2": 7e3}, ddp_processes=1)
    metadata = ddp_calibrated_metadata([rows], graph, "sgd")  # Hopper: no e5m2 forward plans
    assert "op_overhead_us.fp16" in metadata and "op_overhead_us.fp8_e5m2" not in metadata


def test_each_low_precision_op_costs_the_profiles_op_overhead(tmp_path):
    from qsync_lab.allocate.baselines import with_batch_sizes
    from qsync_lab.cluster import load_cluster
    from qsync_lab.graph import trace_graph
    from qsync_lab.plan import Plan
    from qsync_lab.profile import profile_ops
    from qsync_lab.runtime.prediction import predict_plan

    model, (inputs, target), loss_fn = _mlp(), _batch(), nn.CrossEntropyLoss()
    graph = trace_graph(model, inputs, target=target, loss_fn=loss_fn)
    cluster = with_batch_sizes(load_cluster("local-cpu"), [4, 4])
    rows = profile_ops(model, inputs, target, loss_fn, ["fp32", "bf16"], repeats=2, warmup=0,
                       progress=False).assign(batch_size=4)
    plans = {name: Plan.build(graph, cluster, {"cpu": dict.fromkeys(["0", "2"], name)}
                              if name != "fp32" else {}) for name in ("fp32", "bf16")}
    steps = {}
    for overhead in (0.0, 500.0):
        path = tmp_path / f"model{overhead:.0f}.csv"
        write_profile(path, rows, {"device": "cpu", "op_overhead_us.bf16": f"{overhead}; test"})
        costs = CostModel.from_profiles(path, data_file("profiles", "cpu.csv"))
        assert costs.precision_op_overhead_us[("cpu", Precision.BF16)] == overhead
        emulated = costs.emulating("T4", "cpu").precision_op_overhead_us  # an emulated kind
        assert emulated[("T4", Precision.BF16)] == overhead
        results = {name: predict_plan(plan, graph, costs) for name, plan in plans.items()}
        steps[overhead] = {name: result.iteration_us for name, result in results.items()}
    events = results["bf16"].compute[0]
    bf16_forwards = sum(c == "op" and ph == "forward" and p == "bf16" and s.startswith("profile:")
                        for c, ph, p, s in zip(events.category, events.phase, events.precision,
                                               events.source))
    assert bf16_forwards >= 2  # the two planned linears (and the ops that follow them)
    assert steps[500.0]["bf16"] - steps[0.0]["bf16"] == pytest.approx(500.0 * bf16_forwards)
    assert steps[500.0]["fp32"] == pytest.approx(steps[0.0]["fp32"])


def test_the_cache_key_holds_the_optimizer():
    keys = {profile_key("f00d", [16, 16], ["fp32"], threads=1, optimizer=name)
            for name in ("sgd", "sgd_momentum", "adamw")}
    assert len(keys) == 3


def test_concurrent_profiling_times_the_training_step_in_every_process():
    inputs, target = _batch()
    rows = profile_ops_concurrently(_mlp(), inputs, target, nn.CrossEntropyLoss(), ["fp32"],
                                    processes=2, repeats=2, warmup=0, step_optimizer="sgd")
    assert rows.attrs["training_step_us"] > 0
    plain = profile_ops_concurrently(_mlp(), inputs, target, nn.CrossEntropyLoss(), ["fp32"],
                                     processes=1, repeats=2, warmup=0)
    assert "training_step_us" not in plain.attrs
    ddp = profile_ops_concurrently(_mlp(), inputs, target, nn.CrossEntropyLoss(),
                                   ["fp32", "bf16"], processes=2, repeats=2, warmup=0,
                                   step_optimizer="sgd", ddp_steps=["fp32", "bf16"])
    assert set(ddp.attrs["ddp_step_us"]) == {"fp32", "bf16"} and ddp.attrs["ddp_processes"] == 2
    assert min(ddp.attrs["ddp_step_us"].values()) > 0 and "training_step_us" not in ddp.attrs
    with pytest.raises(QSyncError, match="ddp_steps needs a step_optimizer"):
        profile_ops_concurrently(_mlp(), inputs, target, nn.CrossEntropyLoss(), ["fp32"],
                                 ddp_steps=["fp32"])


class _FailsInAllButOneProcess(nn.Module):
    """Works in the process that calls it first (it creates ``marker``), fails in the others."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker, self.linear = marker, nn.Linear(8, 3)

    def forward(self, x):
        if not hasattr(self, "first"):
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
                self.first = True
            except FileExistsError:
                self.first = False
        if not self.first:
            raise RuntimeError("this process's model fails")
        return self.linear(x)


def test_a_failing_profiling_process_does_not_leave_the_other_waiting(tmp_path):
    """The working process waits at the step-timing barrier for the failed one: it must be
    released (and report), not hang the run's rank 0."""
    inputs, target = _batch()
    outcome = []

    def profile():
        try:
            profile_ops_concurrently(_FailsInAllButOneProcess(str(tmp_path / "first")), inputs,
                                     target, nn.CrossEntropyLoss(), ["fp32"], processes=2,
                                     repeats=1, warmup=0, step_optimizer="sgd")
        except QSyncError as err:
            outcome.append(str(err))

    thread = threading.Thread(target=profile, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the profiling hung"
    assert outcome and "profiling process failed" in outcome[0]


@pytest.mark.parametrize("processes", [1, 2])
def test_a_one_model_machine_profile_carries_that_models_step_overhead(tmp_path, processes):
    from qsync_lab.costs import read_profile
    from qsync_lab.profile import ProfileJob, profile_machine

    inputs, target = _batch()
    job = ProfileJob("mlp", _mlp(), inputs, target, nn.CrossEntropyLoss())
    profile_machine([job], tmp_path / "own.csv", precisions=["fp32"], repeats=2,
                    processes=processes, casts=False, links=None, step_optimizer="sgd",
                    progress=False)
    profile_machine([job], tmp_path / "fit.csv", precisions=["fp32"], repeats=2,
                    casts=False, links=None, progress=False)
    own = read_profile(tmp_path / "own.csv").metadata
    assert "training step" in own["step_overhead_us"]
    assert own["event_overhead_us"].startswith("0.000")
    assert "r2=" in read_profile(tmp_path / "fit.csv").metadata["step_overhead_us"]  # MLP fit
