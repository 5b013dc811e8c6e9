"""Profiler: table format, line fits, allreduce and DDP-step runs (not timing-sensitive)."""


import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from qsync_lab.costs import (PROFILE_COLUMNS, link_metadata, load_cost_model, read_link_fits,
                             read_profile, write_device_profile)
from qsync_lab.devices import LinkSpec, load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.profile import (fit_alpha_beta, fit_casts, fit_line, profile_allreduce,
                               profile_casts, profile_ops, run_metadata)


def _tiny_rows():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    return profile_ops(model, (torch.randn(4, 8),), torch.tensor([0, 1, 2, 0]),
                       nn.CrossEntropyLoss(), ["fp32", "int8"], repeats=2, warmup=0,
                       progress=False)


def test_profile_round_trip_and_cost_model(tmp_path):
    rows = _tiny_rows()
    casts = profile_casts([("fp32", "fp16")], [256, 1024, 4096], repeats=2, warmup=0)
    link = LinkSpec("loopback", 3e9, 50e-6, "fit")
    meta = {**run_metadata("cpu", threads=1),
            **link_metadata(link, r2=0.99, world_size=2, backend="gloo")}
    path = tmp_path / "cpu.csv"
    write_device_profile(path, [rows, casts], meta)
    table = read_profile(path)
    assert list(table.frame.columns) == list(PROFILE_COLUMNS)
    assert len(table.frame) == len(rows) + len(casts)
    assert table.metadata["torch_version"] == torch.__version__
    assert table.metadata["threads"] == "1"
    # int8 ops' backward rows are keyed by the precision the backward runs in (fp16)
    backward = table.frame[(table.frame["op"] == "0") & (table.frame["phase"] != "forward")]
    assert set(backward["precision"]) == {"fp32", "fp16"}
    costs = load_cost_model(path)
    cpu = load_catalog().device("cpu")
    assert costs.cast_time_us(1e6, "fp32", "fp16", cpu).source.startswith("fit:")
    cost = costs.allreduce_time_us(1e6, 2, [load_catalog().link("loopback")])
    assert cost.us == pytest.approx((1e6 / 3e9 + 2 * 50e-6) * 1e6)
    assert "R2 0.9900" in cost.source
    # DDP's buffer broadcast uses the fitted link too, and says so
    broadcast = costs.broadcast_time_us(1e6, 2, [load_catalog().link("loopback")])
    assert broadcast.source == cost.source
    assert broadcast.us == pytest.approx((1e6 / 3e9 + 50e-6) * 1e6)
    assert read_link_fits(path)["loopback"].bandwidth_Bps == pytest.approx(3e9)


def test_fit_line_and_casts_recover_a_known_line():
    numel = np.array([1e3, 1e4, 1e5, 1e6])
    rows = pd.DataFrame({"phase": "cast", "precision": "fp32->bf16", "numel": numel,
                         "time_us": 0.25e-3 * numel + 3.0})
    fit = fit_casts(rows)["fp32->bf16"]
    assert fit.slope == pytest.approx(0.25e-3) and fit.intercept == pytest.approx(3.0)
    assert fit.r2 == pytest.approx(1.0)
    noisy = fit_line(numel, 0.25e-3 * numel + 3.0 + np.array([0.1, -0.1, 0.1, -0.1]))
    assert 0.99 < noisy.r2 < 1.0
    with pytest.raises(QSyncError, match="2 distinct"):
        fit_line([1, 1], [2, 3])
    with pytest.raises(QSyncError, match="every y > 0"):
        fit_line([1, 2], [0, 3], relative=True)


def test_alpha_beta_fit_recovers_link():
    sizes = np.geomspace(1e3, 1e8, 8)
    alpha_s, beta = 30e-6, 5e9
    for n in (2, 4):
        steps = 2 * (n - 1)
        times = (steps / n * sizes / beta + steps * alpha_s) * 1e6
        fit = fit_alpha_beta(sizes, times, world_size=n, link="eth")
        assert fit.link.bandwidth_Bps == pytest.approx(beta, rel=1e-6)
        assert fit.link.latency_s == pytest.approx(alpha_s, rel=1e-6)
        assert fit.r2 == pytest.approx(1.0)
    with pytest.raises(QSyncError, match="positive line"):
        fit_alpha_beta(sizes, 100 - sizes * 1e-9, world_size=2, link="eth")


def test_alpha_beta_latency_comes_from_the_small_allreduces_not_the_noise_of_the_large():
    sizes = 4.0 ** np.arange(6, 14)  # 4 KiB .. 64 MiB
    times = 80 + sizes / 2000  # latency term 80 us
    times[-1] *= 1.05  # the 64 MiB allreduce 5 % slow, as under load
    assert fit_line(sizes, times).intercept < 15  # least squares on times: latency lost
    fit = fit_alpha_beta(sizes, times, world_size=2, link="eth")
    assert fit.line.intercept == pytest.approx(80, rel=0.01)


def test_allreduce_measurement_runs_on_gloo():
    rows = profile_allreduce([1024, 65536], repeats=2, warmup=1)
    assert rows["bytes"].tolist() == [1024, 65536]
    assert (rows["time_us"] > 0).all()


def test_a_dead_profiling_process_is_an_error_not_a_hang():
    import queue
    from types import SimpleNamespace

    from qsync_lab.errors import QSyncError
    from qsync_lab.profile.concurrent import _next_result

    empty = queue.Queue()
    with pytest.raises(QSyncError, match="died \\(exit code -9\\)"):
        _next_result(empty, [SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=-9)])
    done = queue.Queue()
    done.put((0, "rows"))
    assert _next_result(done, [SimpleNamespace(exitcode=-9)]) == (0, "rows")
