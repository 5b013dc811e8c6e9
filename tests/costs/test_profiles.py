"""Measured profile tables: format, overrides with their source, calibration, cast fits."""

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn

from qsync_lab.costs import (PROFILE_COLUMNS, CostModel, ProfileTable, calibrate_efficiency,
                             fit_cast_costs, op_work, phase_work, read_profile, shape_key,
                             write_profile)
from qsync_lab.devices import load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph
from qsync_lab.precision import Precision


def _row(**values):
    row = {"device": "T4", "op": "", "kind": "linear", "shape_key": "", "precision": "fp16",
           "phase": "forward", "batch_size": 32, "numel": 0, "flops": 0, "bytes": 0,
           "time_us": 1.0, "repeats": 10}
    row.update(values)
    row.setdefault("plan_precision", row["precision"])
    return row


@pytest.fixture(scope="module")
def work():
    return op_work(trace_graph(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)),
                               torch.randn(2, 64)))


def test_round_trip_with_metadata(tmp_path):
    path = tmp_path / "T4.csv"
    frame = pd.DataFrame([_row(op="fc", time_us=7.5), _row(kind="cast", precision="FP32->fp16",
                                                           phase="cast", numel=100)])
    write_profile(path, frame, {"torch_version": "2.13.0", "cuda_version": "12.8"})
    assert path.read_text().startswith("# torch_version: 2.13.0\n# cuda_version: 12.8\n")
    table = read_profile(path)
    assert table.metadata == {"torch_version": "2.13.0", "cuda_version": "12.8"}
    assert list(table.frame.columns) == list(PROFILE_COLUMNS)
    assert table.casts()[["src", "dst"]].values.tolist() == [["fp32", "fp16"]]
    assert table.op_time_us("T4", "fc", "fp16", "forward", 32) == 7.5
    assert table.op_time_us("T4", "fc", "fp16", "forward", 64) is None


@pytest.mark.parametrize("bad, message", [
    ({"phase": "sideways"}, "unknown phase 'sideways'"),
    ({"precision": "fp12"}, "unknown precision 'fp12'"),
    ({"time_us": -1}, "time_us must be a number >= 0"),
])
def test_bad_rows_raise_one_line_errors(tmp_path, bad, message):
    path = tmp_path / "bad.csv"
    pd.DataFrame([_row(op="fc", **bad)]).to_csv(path, index=False)
    with pytest.raises(QSyncError, match=message):
        read_profile(path)
    with pytest.raises(QSyncError, match="lacks column 'time_us'"):
        pd.DataFrame([_row()]).drop(columns="time_us").to_csv(path, index=False)
        read_profile(path)
    with pytest.raises(QSyncError, match="cannot read profile"):
        read_profile(tmp_path / "missing.csv")


def test_measured_rows_override_roofline_by_fqn_then_shape(work, tmp_path):
    t4 = load_catalog().device("T4")
    path = tmp_path / "T4.csv"
    rows = [_row(op="0", time_us=11.0, batch_size=32),
            # no FQN: matches every op with this kind and shapes (op "2" has them too)
            _row(shape_key=shape_key(work, 2, 32), time_us=22.0, batch_size=32)]
    write_profile(path, pd.DataFrame(rows))
    model = CostModel.from_profiles(path, calibrate=False)
    times, sources = model.op_times_us(work, ["fp16", "fp16", "fp16"], t4, batch_size=32,
                                       phase="forward")
    assert times[0] == 11.0 and times[2] == 22.0
    assert sources == ["profile:T4.csv", "roofline", "profile:T4.csv"]
    other_batch = model.op_time_us(work, "0", "fp16", t4, batch_size=16)
    assert other_batch.source == "roofline"


def test_an_int8_ops_fp16_backward_row_is_not_an_fp16_ops(work, tmp_path):
    t4 = load_catalog().device("T4")
    path = tmp_path / "T4.csv"
    rows = [_row(op="2", phase="backward_input", precision="fp16", plan_precision="int8",
                 time_us=30.0, batch_size=32),
            _row(op="2", phase="backward_input", precision="fp16", time_us=10.0,
                 batch_size=32)]
    write_profile(path, pd.DataFrame(rows))
    model = CostModel.from_profiles(path, calibrate=False)

    def backward_us(plan):
        return model.op_times_us(work, ["fp16"] * 3, t4, batch_size=32, phase="backward_input",
                                 plan_precisions=[plan] * 3)[0][2]

    assert (backward_us("int8"), backward_us("fp16")) == (30.0, 10.0)
    assert read_profile(path).frame["plan_precision"].tolist() == ["int8", "fp16"]


def test_a_profile_without_the_plan_precision_column_still_reads(tmp_path):
    path = tmp_path / "old.csv"
    pd.DataFrame([_row()]).drop(columns="plan_precision").to_csv(path, index=False)
    assert read_profile(path).frame["plan_precision"].tolist() == ["fp16"]


def test_duplicate_shape_keys_average_and_duplicate_fqns_take_the_later_row():
    key = "linear|32x64|w:64x64,64"
    rows = [_row(op="a", shape_key=key, time_us=10.0), _row(op="b", shape_key=key, time_us=30.0),
            _row(op="a", shape_key=key, time_us=20.0)]
    table = ProfileTable.from_frame(pd.DataFrame(rows), "profile:x.csv")
    assert table.op_time_us("T4", "a", "fp16", "forward", 32) == 20.0
    assert table.op_time_us("T4", "c", "fp16", "forward", 32, key) == 20.0  # (10+30+20)/3


@pytest.fixture(scope="module")
def wide():
    """Two Linear(1024, 1024): memory-bound at small batches (the weights), compute-bound
    at large ones."""
    return op_work(trace_graph(nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(),
                                             nn.Linear(1024, 1024)), torch.randn(2, 1024)))


def test_calibrate_efficiency_recovers_factors(wide):
    t4 = load_catalog().device("T4")
    rows = []
    for batch in (1, 8, 4096, 32768):
        flops, nbytes = phase_work(wide, ["fp16"] * 3, "forward", batch_size=batch)
        for i in (0, 2):
            t = max(flops[i] / (65e12 * 0.55), nbytes[i] / (320e9 * 0.6)) * 1e6 + 5.0
            rows.append(_row(op=str(i), batch_size=batch, flops=flops[i], bytes=nbytes[i],
                             time_us=t))
    roof = calibrate_efficiency(pd.DataFrame(rows), t4, source="profile:T4.csv")
    assert roof.compute_efficiency["linear"] == pytest.approx(0.55)
    assert roof.memory_efficiency["linear"] == pytest.approx(0.6)
    assert roof.compute_efficiency["matmul"] == 0.5  # no rows: the initial value stays
    assert roof.source == "fit:profile:T4.csv"
    with pytest.raises(QSyncError, match="no measured op rows for device 'V100-SXM2-32GB'"):
        calibrate_efficiency(pd.DataFrame(rows), load_catalog().device("V100-SXM2-32GB"))


def test_from_profiles_calibrates_and_fits_casts(wide, tmp_path):
    t4 = load_catalog().device("T4")
    path = tmp_path / "T4.csv"
    flops, nbytes = phase_work(wide, ["fp16"] * 3, "forward", batch_size=4096)
    rows = [_row(op="0", batch_size=4096, flops=flops[0], bytes=nbytes[0],
                 time_us=flops[0] / (65e12 * 0.35) * 1e6 + 5.0)]
    rows += [_row(kind="cast", phase="cast", precision="fp32->fp16", batch_size=0, numel=n,
                  time_us=2.0 + n * 1e-5) for n in (1e5, 1e6, 1e7)]
    write_profile(path, pd.DataFrame(rows))
    model = CostModel.from_profiles(path)
    assert model.roofline_for(t4).compute_efficiency["linear"] == pytest.approx(0.35)
    other = model.op_time_us(wide, "2", "fp16", t4, batch_size=4096)  # op 2: not measured
    assert other.source == "fit:profile:T4.csv"
    assert other.us == pytest.approx(flops[2] / (65e12 * 0.35) * 1e6 + 5.0)
    cast = model.cast_time_us(5e6, "fp32", "fp16", t4)
    assert cast.us == pytest.approx(52.0) and cast.source == "fit:profile:T4.csv"
    fits = fit_cast_costs(read_profile(path).frame)
    assert fits[("T4", Precision.FP32, Precision.FP16)].samples == 3
    # an unmeasured pair falls back to the device's (calibrated) roofline
    reverse = model.cast_time_us(5e6, "fp16", "fp32", t4)
    assert reverse.us == pytest.approx(CostModel().cast_time_us(5e6, "fp16", "fp32", t4).us)
    assert np.isclose(model.cast_time_us(0, "fp32", "fp16", t4).us, 2.0)


def test_a_profile_without_host_times_reads_as_before(work, tmp_path):
    """Profiles written before the ``host_us`` column: no host term anywhere."""
    path = tmp_path / "old.csv"
    pd.DataFrame([_row(op="0", time_us=7.5)]).to_csv(path, index=False)
    table = read_profile(path)
    assert table.frame["host_us"].isna().all() and table.op_time_us(
        "T4", "0", "fp16", "forward", 32) == 7.5
    assert table.op_host_us("T4", "0", "fp16", "forward", 32) is None
    model = CostModel.from_profiles(path)
    t4 = load_catalog().device("T4")
    host = model.op_host_times_us(work, t4, batch_size=32, phase="forward",
                                  plan_precisions=["fp16"] * 3)
    assert np.isnan(host).all()
    write_profile(tmp_path / "again.csv", table.frame)  # written back: an empty column
    assert read_profile(tmp_path / "again.csv").frame["host_us"].isna().all()
    pd.DataFrame([_row(op="0", host_us=-3.0)]).to_csv(path, index=False)
    with pytest.raises(QSyncError, match="host_us must be empty or a number >= 0"):
        read_profile(path)


def test_host_times_match_like_op_times_else_the_median_of_the_kind(work, tmp_path):
    h100 = load_catalog().device("H100-SXM5-80GB")
    key = shape_key(work, 0, 32)
    # the same shapes timed in three places of a step, one of which stalled: the median
    rows = [_row(device=h100.name, op="", shape_key=key, time_us=t, host_us=h)
            for t, h in ((5.0, 30.0), (6.0, 50.0), (900.0, 50000.0))]
    rows.append(_row(device=h100.name, kind="activation", op="1", time_us=2.0, host_us=10.0))
    write_profile(tmp_path / "gpu.csv", pd.DataFrame(rows))
    model = CostModel.from_profiles(tmp_path / "gpu.csv")
    host = model.op_host_times_us(work, h100, batch_size=32, phase="forward",
                                  plan_precisions=["fp16"] * 3)
    # op 0 by its shapes; op 1 its own row; op 2 (no row) the median linear
    assert host.tolist() == [50.0, 10.0, 50.0]
    assert model.op_time_us(work, "0", "fp16", h100, batch_size=32).us == 6.0
    at_64 = model.op_host_times_us(work, h100, batch_size=64, phase="forward",
                                   plan_precisions=["fp16"] * 3)
    assert at_64.tolist() == [50.0, 10.0, 50.0]  # issuing an op costs the same at any size
    other_phase = model.op_host_times_us(work, h100, batch_size=32, phase="backward_input",
                                         plan_precisions=["fp16"] * 3)
    assert np.isnan(other_phase).all()


def test_an_unmeasured_op_on_a_host_bound_gpu_costs_the_larger_of_its_work_and_the_floor(
        wide, tmp_path):
    """A GPU profile's small ops take the host's time whatever their work (here 150 us):
    fitted through them, the roofline's efficiencies would fall a hundredfold and a large
    op it did not measure would cost a hundred times its catalog time. The floor model
    keeps the catalog's efficiencies and costs small unmeasured ops at the floor."""
    h200 = load_catalog().device("H200-SXM-141GB")
    rows = []
    for batch in (1, 8, 64):
        flops, nbytes = phase_work(wide, ["bf16"] * 3, "forward", batch_size=batch)
        rows.append(_row(device=h200.name, op="0", precision="bf16", batch_size=batch,
                         flops=flops[0], bytes=nbytes[0], time_us=150.0))
    write_profile(tmp_path / "gpu.csv", pd.DataFrame(rows))
    model = CostModel.from_profiles(tmp_path / "gpu.csv")
    roof = model.roofline_for(h200)
    assert roof.compute_efficiency["linear"] == CostModel().roofline_for(h200).compute_efficiency[
        "linear"]
    assert roof.floor_us[("linear", "bf16")] == pytest.approx(145.0)  # beyond the launch
    for batch in (32, 262144):  # op 2: not measured
        catalog = CostModel().op_time_us(wide, "2", "bf16", h200, batch_size=batch)
        cost = model.op_time_us(wide, "2", "bf16", h200, batch_size=batch)
        assert cost.us == pytest.approx(max(catalog.us, 150.0))
    assert model.op_time_us(wide, "2", "bf16", h200, batch_size=32).source == (
        "floor:profile:gpu.csv")
    assert model.op_time_us(wide, "2", "bf16", h200, batch_size=262144).source == (
        "fit:profile:gpu.csv")
    assert model.op_time_us(wide, "2", "fp32", h200, batch_size=32).source == (
        "fit:profile:gpu.csv")  # no floor measured in fp32
