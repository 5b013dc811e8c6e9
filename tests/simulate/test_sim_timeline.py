"""Known-answer timelines of the 5-op MLP (ops 0..4: linear, relu, linear, relu, linear).

With every op phase taking T us, one iteration's compute stream is: 5 forward ops, then
backward op 4 (input, weight), 3 (input), 2 (input, weight), 1 (input), 0 (weight: its
input is data). So the gradients of layer 4, 2, 0 are final at 7T, 10T and 12T.
"""

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn
from tests.simulate.conftest import (ALLREDUCE_US, BATCH, BUCKET_CAP_MB, CAST_US, FAST, FAST_US, SLOW,
                      SLOW_US, assert_no_overlap, profile_rows)

from qsync_lab.costs import CostModel, write_profile
from qsync_lab.graph import trace_graph
from qsync_lab.models import example_batch, get_model, model_spec
from qsync_lab.cluster import load_cluster
from qsync_lab.simulate import prepare_graph, simulate


def _comm(sim):
    return sim.rank_events(0).query("stream == 'comm'").reset_index(drop=True)


def _compute(sim, rank):
    return sim.rank_events(rank).query("stream == 'compute'").reset_index(drop=True)


def test_compute_stream_order_and_durations(graph, make_cluster, round_costs):
    sim = simulate(graph, {}, make_cluster([FAST]), round_costs, bucket_cap_mb=BUCKET_CAP_MB)
    ops = _compute(sim, 0)
    assert ops["op"].tolist() == ["0", "1", "2", "3", "4", "4", "4", "3", "2", "2", "1", "0",
                                  "optimizer:sgd_momentum"]
    assert ops["phase"].tolist()[5:12] == ["backward_input", "backward_weight",
                                           "backward_input", "backward_input",
                                           "backward_weight", "backward_input",
                                           "backward_weight"]
    assert np.allclose(ops["dur_us"][:12], FAST_US)
    assert set(ops["source"][:12]) == {"profile:profile.csv"}
    assert sim.comm.op == ()  # one rank: no allreduce


def test_last_bucket_allreduce_overlaps_backward(graph, make_cluster, round_costs):
    sim = simulate(graph, {}, make_cluster([FAST, FAST]), round_costs,
                   bucket_cap_mb=BUCKET_CAP_MB)
    comm = _comm(sim)
    t, pack = FAST_US, 2 * CAST_US
    assert comm["op"].tolist() == ["allreduce:bucket0", "allreduce:bucket1", "allreduce:bucket2"]
    # bucket 0 holds layer 4, packed at 7T + pack, and runs while layers 3..0 still run
    # backward (each later bucket's pack also on the compute stream)
    assert comm["start_us"].tolist() == pytest.approx([7 * t + pack, 7 * t + pack + ALLREDUCE_US,
                                                       7 * t + pack + 2 * ALLREDUCE_US])
    assert comm["dur_us"].tolist() == pytest.approx([ALLREDUCE_US] * 3)
    compute = _compute(sim, 0)
    packs = compute.query("category == 'ddp'")
    assert packs["op"].tolist() == ["ddp:pack:bucket0", "ddp:pack:bucket1", "ddp:pack:bucket2",
                                    "ddp:unpack"]
    assert packs["start_us"].tolist()[:3] == pytest.approx(
        [7 * t, 10 * t + pack, 12 * t + 2 * pack])
    backward_end = 12 * t + 3 * pack
    assert comm["start_us"][0] < backward_end
    # GPU ranks: the allreduces do not delay the backward
    assert compute.query("phase == 'backward_weight'")["start_us"].iloc[-1] == pytest.approx(
        11 * t + 2 * pack)
    unpack, optimizer = compute.iloc[-2], compute.iloc[-1]
    assert unpack["start_us"] == pytest.approx(7 * t + pack + 3 * ALLREDUCE_US)
    assert optimizer["start_us"] == pytest.approx(unpack["start_us"] + CAST_US)
    assert sim.iteration_us == pytest.approx(optimizer["start_us"] + optimizer["dur_us"])


def test_cpu_allreduce_delays_the_compute_it_shares_cores_with(graph, make_cluster, tmp_path):
    """On CPU ranks gloo reduces on the computing cores: each allreduce delays every compute
    event that starts after it by its duration."""
    path = tmp_path / "cpu.csv"
    write_profile(path, profile_rows(graph, {"cpu": FAST_US}), {"torch_version": "test"})
    costs = dataclasses.replace(CostModel.from_profiles(path, calibrate=False),
                                casts_in_measured_ops=False)
    sim = simulate(graph, {}, make_cluster(["cpu", "cpu"]), costs, bucket_cap_mb=BUCKET_CAP_MB)
    t, pack, a = FAST_US, 2 * CAST_US, ALLREDUCE_US
    comm, compute = _comm(sim), _compute(sim, 0)
    # bucket 1 is packed at 10T + 2 packs of compute, after allreduce 0 delayed it by A
    assert comm["start_us"].tolist() == pytest.approx(
        [7 * t + pack, 10 * t + 2 * pack + a, 12 * t + 3 * pack + 2 * a])
    starts = compute.set_index(["op", "phase"])["start_us"]
    assert starts[("3", "backward_input")] == pytest.approx(7 * t + pack + a)
    assert starts[("1", "backward_input")] == pytest.approx(10 * t + 2 * pack + 2 * a)
    unpack, optimizer = compute.iloc[-2], compute.iloc[-1]
    assert unpack["op"] == "ddp:unpack"
    assert unpack["start_us"] == pytest.approx(12 * t + 3 * pack + 3 * a)
    assert sim.iteration_us == pytest.approx(unpack["start_us"] + CAST_US + optimizer["dur_us"])
    assert_no_overlap(sim.events)


def test_slow_rank_gates_every_allreduce(graph, make_cluster, round_costs):
    sim = simulate(graph, {}, make_cluster([FAST, SLOW]), round_costs,
                   bucket_cap_mb=BUCKET_CAP_MB)
    comm = _comm(sim)
    pack = 2 * CAST_US
    slow_ready = [7 * SLOW_US + pack, 10 * SLOW_US + 2 * pack, 12 * SLOW_US + 3 * pack]
    # bucket k starts at max(slowest rank's readiness, end of allreduce k-1)
    expected_start = [142.0, 242.0, 342.0]
    assert comm["start_us"].tolist() == pytest.approx(expected_start)
    assert all(s >= r for s, r in zip(comm["start_us"], slow_ready))
    assert all(s > 12 * FAST_US + 3 * pack for s in comm["start_us"][1:])  # the fast rank waits
    comm_end = 342.0 + ALLREDUCE_US
    optimizer_us = max(round_costs.optimizer_time_us(3 * 288, "sgd_momentum", load_cluster(
        "v100-t4-small").catalog.device(d)).us for d in (FAST, SLOW))
    assert sim.iteration_us == pytest.approx(comm_end + CAST_US + optimizer_us)
    assert sim.idle_us[0] > sim.idle_us[1]
    assert sim.idle_us[1] == pytest.approx(sim.iteration_us - 12 * SLOW_US - 3 * pack - CAST_US
                                           - _compute(sim, 1)["dur_us"].iloc[-1])


def test_mixed_plan_puts_casts_exactly_at_boundaries(graph, make_cluster, round_costs):
    sim = simulate(graph, {SLOW: {"2": "fp16"}}, make_cluster([FAST, SLOW]), round_costs)
    assert not (sim.rank_events(0)["category"] == "cast").any()
    casts = _compute(sim, 1).query("category == 'cast'")
    assert casts["op"].tolist() == [
        "cast:2:fp32->fp16", "cast:2:weight:fp32->fp16",  # fp32 relu -> fp16 linear
        "cast:4:fp16->fp32",                               # fp16 relu (follows) -> fp32 linear
        "cast:4:grad:fp32->fp16",                          # gradient back to relu 3
        "cast:2:grad:fp16->fp32", "cast:2:weight_grad:fp16->fp32",
    ]
    assert casts["dur_us"].tolist() == pytest.approx([CAST_US] * 6)
    precisions = _compute(sim, 1).drop_duplicates("op").set_index("op")["precision"]
    assert precisions[["0", "1", "2", "3", "4"]].tolist() == ["fp32", "fp32", "fp16", "fp16",
                                                              "fp32"]


def test_measured_op_times_hold_their_casts(graph, make_cluster, tmp_path):
    """The profiler times runtime ops whole, casts included: no cast events are added."""
    times = {FAST: FAST_US, SLOW: SLOW_US}
    rows = pd.concat([profile_rows(graph, times), profile_rows(graph, times, precision="fp16")])
    write_profile(tmp_path / "p.csv", rows)
    measured = CostModel.from_profiles(tmp_path / "p.csv", calibrate=False)
    cluster = make_cluster([FAST, SLOW])
    sim = simulate(graph, {SLOW: {"2": "fp16"}}, cluster, measured)
    assert not (_compute(sim, 1)["category"] == "cast").any()
    bare = dataclasses.replace(measured, casts_in_measured_ops=False)
    with_casts = simulate(graph, {SLOW: {"2": "fp16"}}, cluster, bare)
    assert (_compute(with_casts, 1)["category"] == "cast").sum() == 6
    assert with_casts.iteration_us - sim.iteration_us == pytest.approx(6 * CAST_US)


def test_fitted_step_overheads_apply_to_measured_ranks(graph, make_cluster, tmp_path):
    rows = profile_rows(graph, {FAST: FAST_US, SLOW: SLOW_US})
    write_profile(tmp_path / "plain.csv", rows)
    write_profile(tmp_path / "fitted.csv", rows, {"device": SLOW, "step_overhead_us": "250; r2=1",
                                                  "event_overhead_us": "-2.5; r2=1"})
    cluster = make_cluster([SLOW])
    plain, fitted = (simulate(graph, {}, cluster, CostModel.from_profiles(
        tmp_path / f"{name}.csv", calibrate=False)) for name in ("plain", "fitted"))
    events = _compute(fitted, 0)
    framework = events.query("category == 'framework'")
    assert framework["dur_us"].tolist() == [250.0] and framework["start_us"].tolist() == [0.0]
    ops = (_compute(plain, 0)["category"] == "op").sum()
    assert (events.query("category == 'op'")["dur_us"] == SLOW_US - 2.5).all()
    assert fitted.iteration_us - plain.iteration_us == pytest.approx(250 - 2.5 * ops)


def test_int8_ops_run_backward_in_fp16(graph, make_cluster, round_costs):
    sim = simulate(graph, {SLOW: {"2": "int8"}}, make_cluster([FAST, SLOW]), round_costs)
    events = _compute(sim, 1)
    op2 = events.query("fqn == '2' and category == 'op'")
    assert op2[["phase", "precision", "plan_precision"]].values.tolist() == [
        ["forward", "int8", "int8"], ["backward_input", "fp16", "int8"],
        ["backward_weight", "fp16", "int8"]]
    casts = events.query("category == 'cast'")["op"].tolist()
    assert casts == ["cast:2:fp32->int8", "cast:2:weight:fp32->int8",  # int8 writes fp32
                     "cast:2:grad_out:fp32->fp16", "cast:2:saved:int8->fp16",
                     "cast:2:grad:fp16->fp32", "cast:2:weight_grad:fp16->fp32"]


def test_no_overlap_per_stream_and_shared_classes():
    model = get_model("bert_mini")
    inputs, target = example_batch("bert_mini", 2)
    graph = trace_graph(model, inputs, target=target, loss_fn=model_spec("bert_mini").loss_fn())
    plan = {"T4": {n: "fp16" for n, k in graph.ops["kind"].items() if k == "linear"}}
    sim = simulate(graph, plan, load_cluster("v100-t4-small"), CostModel(), optimizer="adam")
    assert_no_overlap(sim.events)
    for rank in range(sim.world_size):  # the optimizer ends the iteration on every rank
        assert _compute(sim, rank)["op"].iloc[-1] == "optimizer:adam"
    same = sim.rank_events(2).drop(columns="rank")
    assert same.equals(sim.rank_events(3).drop(columns="rank"))
    assert len(sim.events) == sum(len(sim.rank_events(r)) for r in range(4))
    assert sim.wire_bytes[0] == pytest.approx(2 * 3 / 4 * graph.params["bytes"].sum())


def test_batch_size_scales_compute_not_parameters(make_cluster):
    graph = trace_graph(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)),
                        torch.randn(BATCH, 256))
    prepared = prepare_graph(graph)
    small = simulate(prepared, {}, make_cluster([FAST, FAST], [64, 64]), CostModel())
    big = simulate(prepared, {}, make_cluster([FAST, FAST], [64, 4096]), CostModel())
    small_fwd = _compute(small, 1).query("phase == 'forward'")
    big_fwd = _compute(big, 1).query("phase == 'forward'")
    assert (big_fwd["bytes"].to_numpy() > small_fwd["bytes"].to_numpy()).all()
    # at 4096 the activations outweigh the gradients: the peak is at the start of backward,
    # the saved input of the first Linear and the ReLU's output (the second Linear's saved
    # input, the same tensor) of 4096x256 fp32 held
    assert big.memory_breakdown.loc[1, "activations"] == 4096 * 2 * 256 * 4
    assert big.tensor_peak_bytes[1] > small.tensor_peak_bytes[1]
    assert big.memory_breakdown.loc[1, "master_weights"] == small.memory_breakdown.loc[
        1, "master_weights"]
    assert big.idle_us[0] > big.idle_us[1]  # the rank with 64x the batch gates the other
    assert big.throughput_samples_per_s == pytest.approx((64 + 4096) / (big.iteration_us / 1e6))


def test_prepared_graph_gives_the_same_result(graph, make_cluster, round_costs):
    cluster = make_cluster([FAST, SLOW])
    direct = simulate(graph, {SLOW: {"2": "fp16"}}, cluster, round_costs)
    prepared = simulate(prepare_graph(graph), {SLOW: {"2": "fp16"}}, cluster, round_costs)
    assert direct.iteration_us == prepared.iteration_us
    assert direct.events.equals(prepared.events)


def test_ddp_broadcasts_the_buffers_before_every_forward(make_cluster):
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    graph = trace_graph(model, torch.randn(4, 8))
    # running_mean, running_var (16 fp32 each) and num_batches_tracked (one int64)
    assert graph.buffer_bytes == 2 * 16 * 4 + 8
    costs = CostModel()
    cluster = make_cluster([FAST, SLOW])
    two = simulate(graph, {}, cluster, costs)
    first = two.rank_events(1).query("stream == 'compute'").iloc[0]
    expected = costs.broadcast_time_us(graph.buffer_bytes, 2, cluster.intra_node_links).us
    assert (first["op"], first["start_us"]) == ("ddp:broadcast_buffers", 0.0)
    assert first["dur_us"] == pytest.approx(expected) and expected > 0
    one = simulate(graph, {}, make_cluster([SLOW]), costs)
    assert "ddp:broadcast_buffers" not in set(one.events["op"])
