"""Known-answer set-up: a 5-op MLP, measured tables with round times, tiny clusters.

Every op phase of the MLP takes ``FAST_US`` on the V100 and ``SLOW_US`` on the T4 (a
profile overrides the roofline), every cast takes ``CAST_US`` (a fitted line with zero
slope; an ``fp32->fp32`` in-place copy too, so DDP packs a bucket in ``2 * CAST_US`` and
unpacks the buckets in ``CAST_US``), and the link moves one 288-byte bucket between two
ranks in ``ALLREDUCE_US``.
"""

import dataclasses

import numpy as np

import pandas as pd
import pytest
import torch
import torch.nn as nn

from qsync_lab.cluster import load_cluster
from qsync_lab.costs import CostModel, op_work, phase_work, write_profile
from qsync_lab.graph import trace_graph
from qsync_lab.precision import Precision

FAST, SLOW = "V100-SXM2-32GB", "T4"
FAST_US, SLOW_US, CAST_US = 10.0, 20.0, 1.0
BATCH = 2
LAYER_BYTES = 8 * 8 * 4 + 8 * 4  # one Linear(8, 8): weight + bias, fp32
ALLREDUCE_US = 100.0
#: bucket cap that closes one bucket per Linear(8, 8) (bias 32 B, then weight: 288 >= 256)
BUCKET_CAP_MB = 256 / 2**20


def mlp5() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


@pytest.fixture(scope="session")
def graph():
    return trace_graph(mlp5(), torch.randn(BATCH, 8))


def _cluster_toml(path, devices: list[str], batch_sizes: list[int]) -> str:
    groups = ", ".join(f'{{ kind = "{d}", count = 1, batch_size = {b} }}'
                       for d, b in zip(devices, batch_sizes))
    # 2 ranks: a ring allreduce sends S bytes per rank -> S / bandwidth = 100 us for 288 B
    bandwidth_GBps = LAYER_BYTES / (ALLREDUCE_US * 1e-6) / 1e9
    path.write_text(f'name = "test"\n\n[[node]]\nname = "n0"\n'
                    f'intra_node_link = {{ bandwidth_GBps = {bandwidth_GBps!r}, latency_us = 0 }}\n'
                    f"devices = [{groups}]\n")
    return str(path)


@pytest.fixture
def make_cluster(tmp_path):
    """``make_cluster([device, ...], [batch, ...])`` -> a one-node Cluster."""
    def make(devices, batch_sizes=None):
        batch_sizes = batch_sizes or [BATCH] * len(devices)
        return load_cluster(_cluster_toml(tmp_path / f"c{len(list(tmp_path.iterdir()))}.toml",
                                          devices, batch_sizes))
    return make


def profile_rows(graph, times_us: dict[str, float], batch_size: int = BATCH,
                 precision: str = "fp32") -> pd.DataFrame:
    """A measured row for every op phase with work, at ``times_us[device]``."""
    work = op_work(graph)
    rows = []
    for phase in ("forward", "backward_input", "backward_weight"):
        flops, nbytes = phase_work(work, [precision] * len(work), phase, batch_size=batch_size)
        for i, name in enumerate(work.names):
            if flops[i] > 0 or nbytes[i] > 0:
                for device, time_us in times_us.items():
                    rows.append({"device": device, "op": name, "kind": work.kinds[i],
                                 "shape_key": "", "precision": precision, "phase": phase,
                                 "batch_size": batch_size, "numel": 0, "flops": flops[i],
                                 "bytes": nbytes[i], "time_us": time_us, "repeats": 5})
    for device in times_us:
        for src, dst in [(a, b) for a in Precision for b in Precision
                         if a is not b or a is Precision.FP32]:
            for numel in (1000, 2000):
                rows.append({"device": device, "op": "", "kind": "cast", "shape_key": "",
                             "precision": f"{src}->{dst}", "phase": "cast",
                             "batch_size": 0, "numel": numel, "flops": 0, "bytes": 0,
                             "time_us": CAST_US, "repeats": 5})
    return pd.DataFrame(rows)


@pytest.fixture
def round_costs(graph, tmp_path) -> CostModel:
    """Every op phase: 10 us on the V100, 20 us on the T4; every cast and copy 1 us (its own
    event: these made-up op times hold no casts)."""
    path = tmp_path / "profile.csv"
    write_profile(path, profile_rows(graph, {FAST: FAST_US, SLOW: SLOW_US}),
                  {"torch_version": torch.__version__})
    return dataclasses.replace(CostModel.from_profiles(path, calibrate=False),
                               casts_in_measured_ops=False)


def assert_no_overlap(events: pd.DataFrame) -> None:
    for (_, _), stream in events.groupby(["rank", "stream"]):
        start = stream["start_us"].to_numpy()
        end = start + stream["dur_us"].to_numpy()
        order = np.argsort(start, kind="stable")
        assert np.all(start[order][1:] >= end[order][:-1] - 1e-9)
