"""The DDP-calibrated link: the fit recovers a known α–β, and the measurement runs real
2-rank gloo DDP steps."""

import pandas as pd
import pytest

from qsync_lab.costs import CostModel, link_metadata, load_cost_model, write_device_profile
from qsync_lab.devices import LinkSpec
from qsync_lab.errors import QSyncError
from qsync_lab.profile import (LineFit, copy_pass_us, fit_buffer_broadcast, fit_ddp_link,
                               measure_buffer_broadcast, measure_ddp_overhead)


def _frame(alpha_us, us_per_byte, copy):
    buckets = [1, 1, 2, 2, 3]
    wire = [1e5, 2e6, 3e6, 8e6, 2e7]
    added_us = [2 * alpha_us * b + w * us_per_byte + 3 * copy(w) for b, w in zip(buckets, wire)]
    return pd.DataFrame({"buckets": buckets, "wire_bytes": wire, "bucket_bytes": wire,
                         "plain_ms": 1.0, "ddp_ms": [1.0 + a / 1e3 for a in added_us]})


def test_fit_recovers_a_known_link_after_the_copies():
    copy = copy_pass_us({"fp32->fp32": LineFit(0.2e-3, -20.0, 1.0, 4)})
    fit = fit_ddp_link(_frame(300.0, 1e-3, copy), copy, link="loopback")
    assert fit.link.latency_s * 1e6 == pytest.approx(300.0)
    assert fit.link.bandwidth_Bps == pytest.approx(1e9)  # 1e-3 us per byte
    assert fit.line.r2 == pytest.approx(1.0) and fit.link.name == "loopback"
    assert fit.link.source.startswith("fit:ddp-calibration")
    # forgetting the copies would make the link look slower
    naive = fit_ddp_link(_frame(300.0, 1e-3, copy), lambda b: 0.0, link="loopback")
    assert naive.link.bandwidth_Bps < 0.9e9


def test_fit_rejects_too_few_models_and_a_negative_link():
    copy = copy_pass_us({"fp32->fp32": LineFit(0.0, 0.0, 1.0, 2)})
    with pytest.raises(QSyncError, match="at least 2"):
        fit_ddp_link(_frame(300.0, 1e-3, copy).head(1), copy, link="x")
    with pytest.raises(QSyncError, match="positive"):
        fit_ddp_link(_frame(-300.0, 1e-3, copy), copy, link="x")
    with pytest.raises(QSyncError, match="fp32->fp32"):
        copy_pass_us({})


def test_measurement_runs_real_ddp_steps():
    frame = measure_ddp_overhead([(16, 1), (16, 3)], steps=3, warmup=1)
    assert frame[["width", "depth"]].values.tolist() == [[16, 1], [16, 3]]
    assert frame["buckets"].tolist() == [1, 1]
    assert frame["bucket_bytes"].tolist() == [4.0 * (16 * 16 + 16), 4.0 * 3 * (16 * 16 + 16)]
    assert (frame["plain_ms"] > 0).all() and (frame["ddp_ms"] > 0).all()
    with pytest.raises(QSyncError, match="world_size"):
        measure_ddp_overhead([(16, 1)], world_size=1)


def test_buffer_broadcast_fit_is_the_median_added_latency_per_hop():
    frame = pd.DataFrame({"buffer_bytes": [1e6, 1e6, 1e6], "without_ms": [2.0, 2.0, 2.0],
                          "with_ms": [3.5, 3.6, 9.0]})  # one disturbed step median
    link = LinkSpec("loopback", 1e9, 100e-6, "fit:x")   # 1 MB takes 1000 us of the added
    fit = fit_buffer_broadcast(frame, link, world_size=3)
    assert fit.name == "loopback-ddp-broadcast" and fit.bandwidth_Bps == 1e9
    assert fit.latency_s * 1e6 == pytest.approx((1600 - 1000) / 2)  # the median, per hop
    with pytest.raises(QSyncError, match="added no time"):
        fit_buffer_broadcast(frame.assign(with_ms=2.0), link)


def test_the_cost_model_broadcasts_over_the_measured_buffer_broadcast(tmp_path):
    link = LinkSpec("loopback", 1e9, 100e-6, "catalog")
    broadcast = LinkSpec("loopback-ddp-broadcast", 1e9, 700e-6, "fit:bb")
    path = tmp_path / "p.csv"
    write_device_profile(path, [], {**link_metadata(link, r2=1.0, world_size=2, backend="gloo"),
                                    **link_metadata(broadcast, r2=float("nan"), world_size=2,
                                                    backend="gloo")})
    costs = load_cost_model(path)
    cost = costs.broadcast_time_us(1e6, 2, [link])
    assert cost.us == pytest.approx(700 + 1000) and "loopback-ddp-broadcast" in cost.source
    assert costs.allreduce_time_us(1e6, 2, [link]).source.startswith("alpha-beta:loopback (")
    plain = CostModel(link_fits={"loopback": link}).broadcast_time_us(1e6, 2, [link])
    assert plain.us == pytest.approx(100 + 1000)  # no broadcast fit: the link's own α


@pytest.mark.parametrize("fields", ["latency_us=-50000.0; bandwidth_GBps=2.0",
                                    "latency_us=40.0; bandwidth_GBps=-1.0",
                                    "latency_us=40.0; bandwidth_GBps=0.0",
                                    "latency_us=nan; bandwidth_GBps=2.0",
                                    "latency_us=40.0; bandwidth_GBps=inf"])
def test_a_link_fit_no_measurement_gives_is_refused(tmp_path, fields):
    """A negative latency simulated a 2-rank step of -200 ms; a zero bandwidth, an
    infinite one."""
    path = tmp_path / "p.csv"
    write_device_profile(path, [], {"link.loopback": f"{fields}; r2=1.0"})
    with pytest.raises(QSyncError, match=r"metadata 'link.loopback' needs latency_us=<number "
                       r">= 0>; bandwidth_GBps=<number > 0>, got .*; measure the link again"):
        load_cost_model(path)


def test_buffer_broadcast_measurement_runs_real_ddp_steps():
    frame = measure_buffer_broadcast([(16, 1)], steps=3, warmup=1)
    assert frame["buffer_bytes"].tolist() == [2 * 16 * 4 + 8]  # running mean, var, count
    assert (frame["without_ms"] > 0).all() and (frame["with_ms"] > 0).all()


def _mlp_frame(added_ms: float):
    """One calibration row for the 512x4 MLP: the hook added ``added_ms`` beyond DDP."""
    return pd.DataFrame({"spec": ["global_qsgd:8"], "width": [512], "depth": [4],
                         "ddp_ms": [10.0], "compressed_ms": [10.0 + added_ms]})


def test_compressed_step_residual_is_what_the_estimate_left_out(tmp_path):
    from qsync_lab.cluster import load_cluster
    from qsync_lab.costs.profiles import read_profile
    from qsync_lab.graph import trace_graph
    from qsync_lab.profile import fit_compressed_steps
    from qsync_lab.profile.ddp_link import _mlp
    from qsync_lab.simulate import prepare_graph
    from qsync_lab.simulate.compression import bucket_comm

    cluster, costs = load_cluster("local-cpu"), CostModel()
    prepared = prepare_graph(trace_graph(_mlp(512, 4), __import__("torch").randn(16, 512)))
    estimate_ms = (sum(b.cost.us for b in bucket_comm(prepared, cluster, costs, "global_qsgd:8"))
                   - sum(b.cost.us for b in bucket_comm(prepared, cluster, costs, None))) / 1e3
    rows = fit_compressed_steps(_mlp_frame(estimate_ms + 5.0), costs, cluster)
    # DDP's first bucket holds 1 MiB: the 4 weights (compressed) share two buckets, so two
    # group calls, each given half the elements and half the residual
    assert rows[["op", "kind", "phase", "numel"]].values.tolist() == [
        ["global_qsgd:8", "in_step", "compress", 2 * 512 * 512]]
    assert rows["time_us"].iloc[0] == pytest.approx(2500.0)
    below = fit_compressed_steps(_mlp_frame(estimate_ms - 1.0), costs, cluster)
    assert below["time_us"].iloc[0] == pytest.approx(-500.0)  # a residual may be negative
    # through a profile: the cost model's in-step line, and the simulator adds it
    path = tmp_path / "cpu.csv"
    write_device_profile(path, [pd.concat([rows, rows.assign(numel=2 * 4 * 512 * 512)])], {})
    assert (read_profile(path).frame["time_us"] == 2500.0).all()
    measured = load_cost_model(path)
    cpu = cluster.catalog.device("cpu")
    assert measured.compression_in_step_us("global_qsgd:8", 1e6, cpu).us == pytest.approx(2500)
    with_line = sum(b.cost.us for b in bucket_comm(prepared, cluster, measured, "global_qsgd:8"))
    without = sum(b.cost.us for b in bucket_comm(prepared, cluster, costs, "global_qsgd:8"))
    assert with_line - without == pytest.approx(5000.0)  # the line once per call: all of it


def test_a_negative_time_is_read_only_in_an_in_step_row(tmp_path):
    from qsync_lab.costs.profiles import read_profile

    row = {"device": "cpu", "op": "fp16", "kind": "in_step", "shape_key": "",
           "precision": "fp32", "plan_precision": "fp32", "phase": "compress",
           "batch_size": 16, "numel": 1000, "flops": 0, "bytes": 0, "time_us": -5.0,
           "repeats": 0}
    write_device_profile(tmp_path / "ok.csv", [pd.DataFrame([row])], {})
    assert read_profile(tmp_path / "ok.csv").frame["time_us"].iloc[0] == -5.0
    with pytest.raises(QSyncError, match="time_us must be a number >= 0"):
        write_device_profile(tmp_path / "bad.csv", [pd.DataFrame([{**row, "kind": "encode"}])],
                             {})


def test_measure_compressed_steps_runs_ddp_with_and_without_the_hook():
    from qsync_lab.profile import measure_compressed_steps

    frame = measure_compressed_steps(["cgx:4"], [(64, 2)], steps=4, warmup=1)
    assert frame[["spec", "width", "depth"]].values.tolist() == [["cgx:4", 64, 2]]
    assert (frame[["ddp_ms", "compressed_ms"]] > 0).all(axis=None)
