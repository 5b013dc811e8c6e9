"""Roofline numbers against hand calculations on catalog devices."""

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn

from qsync_lab.costs import (CostModel, Roofline, calibrate_efficiency, default_roofline,
                             op_work)
from qsync_lab.devices import load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph


@pytest.fixture(scope="module")
def big_linear():
    return op_work(trace_graph(nn.Linear(1024, 4096), torch.randn(2, 1024)))


def test_compute_bound_linear_on_t4(big_linear):
    t4 = load_catalog().device("T4")
    flops = 2 * 512 * 1024 * 4096 + 512 * 4096  # batch 512
    expected = flops / (65e12 * 0.7) * 1e6 + 5.0  # fp16 tensor peak, linear efficiency, launch
    cost = CostModel().op_time_us(big_linear, "linear", "fp16", t4, batch_size=512)
    assert cost.us == pytest.approx(expected)
    assert cost.source == "roofline"


def test_memory_bound_linear_on_v100(big_linear):
    v100 = load_catalog().device("V100-SXM2-32GB")
    nbytes = 1 * 1024 * 4 + (1024 * 4096 + 4096) * 4 + 1 * 4096 * 4  # batch 1, fp32
    expected = nbytes / (900e9 * 0.8) * 1e6 + 5.0
    cost = CostModel().op_time_us(big_linear, "linear", "fp32", v100, batch_size=1)
    assert cost.us == pytest.approx(expected)
    int8 = CostModel().op_time_us(big_linear, "linear", "int8", load_catalog().device("T4"),
                                  batch_size=1)
    assert int8.us < CostModel().op_time_us(big_linear, "linear", "fp32",
                                            load_catalog().device("T4"), batch_size=1).us


def test_unsupported_precision_and_unknown_op(big_linear):
    v100 = load_catalog().device("V100-SXM2-32GB")
    with pytest.raises(QSyncError, match="does not support int8"):
        CostModel().op_time_us(big_linear, "linear", "int8", v100, batch_size=1)
    with pytest.raises(QSyncError, match="unknown op 'linaer'; did you mean linear"):
        CostModel().op_time_us(big_linear, "linaer", "fp32", v100, batch_size=1)


def test_cast_allreduce_optimizer_hand_counts():
    catalog = load_catalog()
    t4 = catalog.device("T4")
    model = CostModel()
    assert model.cast_time_us(1e6, "fp32", "int8", t4).us == pytest.approx(
        5e6 / (320e9 * 0.8) * 1e6 + 5.0)
    nvlink, eth = catalog.link("nvlink2"), catalog.link("eth_100g")
    cost = model.allreduce_time_us(64e6, 8, [nvlink, eth])  # slowest: eth bandwidth
    assert cost.us == pytest.approx((2 * 7 / 8 * 64e6 / 12.5e9 + 2 * 7 * 20e-6) * 1e6)
    assert cost.source == "alpha-beta:eth_100g"
    assert model.allreduce_time_us(64e6, 1, [eth]).us == 0
    sgd = model.optimizer_time_us(1e8, "sgd", t4).us
    momentum = model.optimizer_time_us(1e8, "sgd_momentum", t4).us
    # traffic: the finite check reads the gradients, then 3 (+2 per state) passes
    assert (momentum - 5) / (sgd - 5) == pytest.approx(6 / 4)
    with pytest.raises(QSyncError, match="unknown optimizer 'lamb'"):
        model.optimizer_time_us(1e8, "lamb", t4)


def test_roofline_table_is_data():
    frame = default_roofline().to_frame()
    assert frame.loc["conv2d", "compute_efficiency"] == 0.6
    with pytest.raises(QSyncError, match="needs an 'other' entry"):
        Roofline({"linear": 0.5}, {"other": 0.8})
    with pytest.raises(QSyncError, match="must be positive"):
        Roofline({"other": 0.0}, {"other": 0.8})
    v100 = load_catalog().device("V100-SXM2-32GB")
    zero = default_roofline().times_us(np.zeros(1), np.zeros(1), ["view"], v100, ["fp32"])
    assert zero.tolist() == [0.0]


def test_catalog_efficiencies_replace_the_defaults_on_their_device(big_linear):
    """The H200's measured GEMM and copy ratios cost its ops; other devices keep the
    initial factors, and a profile's calibration starts from the catalog's."""
    catalog = load_catalog()
    h200, a100 = catalog.device("H200-SXM-141GB"), catalog.device("A100-SXM4-80GB")
    flops = 2 * 512 * 1024 * 4096 + 512 * 4096  # batch 512
    cost = CostModel().op_time_us(big_linear, "linear", "bf16", h200, batch_size=512)
    assert cost.us == pytest.approx(flops / (989.4e12 * 0.796) * 1e6 + 5.0)
    assert cost.source == "roofline"
    nbytes = 1 * 1024 * 4 + (1024 * 4096 + 4096) * 4 + 1 * 4096 * 4  # batch 1, fp32
    small = CostModel().op_time_us(big_linear, "linear", "fp32", h200, batch_size=1)
    assert small.us == pytest.approx(nbytes / (4800e9 * 0.896) * 1e6 + 5.0)
    model = CostModel()
    assert model.roofline_for(h200).efficiency(["conv2d"])[0].tolist() == [0.6]  # the default
    assert model.roofline_for(a100) is model.default_roofline
    conv_rows = pd.DataFrame({"device": h200.name, "kind": "conv2d", "precision": "bf16",
                              "phase": "forward", "flops": [1e12], "bytes": [1e6],
                              "time_us": [2e3 + 5]})
    fitted = calibrate_efficiency(conv_rows, h200)
    assert fitted.efficiency(["conv2d", "linear"])[0] == pytest.approx([1 / 1.9788, 0.796])
    assert fitted.memory_efficiency["linear"] == 0.896
