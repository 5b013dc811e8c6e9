"""Compressed gradient communication in the simulator: bytes on the wire, the cost of each
step (scale sync, encode, collective, decode) against the α–β formulas, measured encode and
decode lines overriding the roofline, mixed buckets, and the plan's settings in simulate()."""

import dataclasses

import pytest
import torch
import torch.nn as nn

from qsync_lab.cluster import load_cluster
from qsync_lab.compress import CompressionSpec
from qsync_lab.costs import CostModel
from qsync_lab.costs.calibrate import CastFit
from qsync_lab.devices import US_PER_SECOND
from qsync_lab.graph import trace_graph
from qsync_lab.plan import Plan
from qsync_lab.simulate import prepare_graph, simulate
from qsync_lab.simulate.compression import bucket_comm

N = 2048 * 2048  # elements of one weight (a bucket holds one weight and one bias)


@pytest.fixture(scope="module")
def prepared():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048))
    return prepare_graph(trace_graph(model, torch.randn(2, 2048)))


@pytest.fixture(scope="module")
def cluster():
    return load_cluster("v100-t4-small")


def _alpha_beta(cluster):
    link = min(cluster.ring_links(), key=lambda link: link.bandwidth_Bps)
    return link.latency_s * US_PER_SECOND, link.bandwidth_Bps / US_PER_SECOND


def test_fp32_is_the_plain_ring_allreduce(prepared, cluster):
    world, costs = cluster.world_size, CostModel()
    plain = bucket_comm(prepared, cluster, costs, None)
    alpha, bytes_per_us = _alpha_beta(cluster)
    assert len(plain) == len(prepared.bucket_bytes)
    for bucket, size in zip(plain, prepared.bucket_bytes):
        ring = 2 * (world - 1) / world * size
        assert bucket.label == "fp32" and bucket.sent_bytes == pytest.approx(ring)
        assert bucket.cost.us == pytest.approx(ring / bytes_per_us + 2 * (world - 1) * alpha)


def test_global_qsgd_costs_its_scale_sync_encode_int8_allreduce_and_one_decode(prepared,
                                                                                 cluster):
    world, costs = cluster.world_size, CostModel()
    spec = CompressionSpec.parse("global_qsgd:8")
    weight_numel = 2 * N  # the two weights; biases (1-D) go uncompressed
    alpha, bytes_per_us = _alpha_beta(cluster)
    ring = 2 * (world - 1) / world
    slow = min((cluster.catalog.device(k) for k in cluster.device_kinds),
               key=lambda d: d.memory_bandwidth_Bps)
    buckets = bucket_comm(prepared, cluster, costs, spec)
    assert {b.label for b in buckets} <= {"fp32 + global_qsgd:8", "global_qsgd:8", "fp32"}
    compressed = sum(b.sent_bytes for b in buckets)
    plain = sum(b.sent_bytes for b in bucket_comm(prepared, cluster, costs, None))
    bias_bytes = 2 * 2048 * 4
    assert compressed == pytest.approx(ring * (weight_numel + bias_bytes)
                                       + ring * 4 * len(buckets), rel=1e-9)
    assert compressed < plain / 3.9
    # one bucket holding one weight: every term checked
    one = next(b for b in buckets if b.label == "fp32 + global_qsgd:8")
    encode = costs.compression_time_us("global_qsgd:8", "encode", N, 9, slow).us
    decode = costs.compression_time_us("global_qsgd:8", "decode", N, 5, slow).us
    want = ((ring * 4 / bytes_per_us + 2 * (world - 1) * alpha)            # MAX of the scale
            + encode + (ring * N / bytes_per_us + 2 * (world - 1) * alpha)  # int8 codes
            + decode + (ring * 2048 * 4 / bytes_per_us + 2 * (world - 1) * alpha))  # bias
    assert one.cost.us == pytest.approx(want)
    assert "compress:global_qsgd:8" in one.cost.source


def test_cgx_all_gathers_and_decodes_every_ranks_payload(prepared, cluster):
    world, costs = cluster.world_size, CostModel()
    spec = CompressionSpec.parse("cgx:4")
    buckets = bucket_comm(prepared, cluster, costs, spec)
    payload = N // 8 * 4 + 8 * (N // spec.group_size)
    one = next(b for b in buckets if "cgx" in b.label)
    bias_sent = 2 * (world - 1) / world * 2048 * 4
    assert one.sent_bytes == pytest.approx((world - 1) * payload + bias_sent)
    slow_decode = CostModel(compress_fits={
        (d, "cgx:4", "decode"): CastFit(0.0, 1000.0, 2, "fit:test") for d in cluster.device_kinds})
    slower = next(b for b in bucket_comm(prepared, cluster, slow_decode, spec) if "cgx" in b.label)
    roofline_decode = costs.compression_time_us("cgx:4", "decode", N, 8.5, cluster.catalog.device(
        cluster.device_kinds[-1])).us
    assert slower.cost.us - one.cost.us == pytest.approx(world * (1000.0 - roofline_decode),
                                                         rel=1e-6)


def test_measured_lines_key_on_the_cost_label_and_error_feedback_costs_more(prepared, cluster):
    costs = CostModel()
    plain = bucket_comm(prepared, cluster, costs, "cgx:4")
    feedback = bucket_comm(prepared, cluster, costs, "cgx:4,error_feedback=true")
    assert all(f.cost.us > p.cost.us for f, p in zip(feedback, plain) if "cgx" in p.label)
    fits = {(d, "cgx:4,error_feedback=true", step): CastFit(0.0, 7000.0, 2, "fit:t")
            for d in cluster.device_kinds for step in ("encode", "decode")}
    measured = bucket_comm(prepared, cluster, dataclasses.replace(costs, compress_fits=fits),
                           "cgx:4,error_feedback=true,min_numel=16")
    assert all("fit:t" not in b.cost.source for b in measured)  # the source names the link
    assert sum(b.cost.us for b in measured) > sum(b.cost.us for b in feedback) + 7000


def test_simulate_takes_the_plans_compression_and_reports_compressed_events(prepared, cluster):
    plan = Plan.build(prepared.graph, cluster, {}, compression="global_qsgd:8")
    compressed = simulate(prepared, plan)
    plain = simulate(prepared, {}, cluster)
    assert compressed.wire_bytes.iloc[0] < plain.wire_bytes.iloc[0] / 3.9
    comm = compressed.events[compressed.events["stream"] == "comm"]
    assert set(comm["category"]) <= {"compressed", "allreduce"}
    assert "compressed" in set(comm["category"])
    assert any("global_qsgd:8" in p for p in comm["plan_precision"])
    explicit = simulate(prepared, {}, cluster, compression="global_qsgd:8")
    assert explicit.iteration_us == pytest.approx(compressed.iteration_us)
