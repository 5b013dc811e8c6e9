"""Peak memory against a hand count on a 2-layer model."""

import pytest
import torch
import torch.nn as nn
from tests.simulate.conftest import FAST, SLOW

from qsync_lab.costs import CostModel
from qsync_lab.graph import trace_graph
from qsync_lab.simulate import simulate


def test_memory_equals_hand_count_on_two_layers(make_cluster):
    # Linear(8, 16) -> ReLU -> Linear(16, 4), traced at batch 2, run at batch 4 (x2)
    graph = trace_graph(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                        torch.randn(2, 8))
    sim = simulate(graph, {SLOW: {"0": "fp16"}}, make_cluster([FAST, SLOW], [4, 4]),
                   CostModel(), optimizer="adam")
    params = (16 * 8 + 16) + (4 * 16 + 4)  # 212 elements
    fp32 = 4
    expected_t4 = {
        "master_weights": params * fp32,
        "low_precision_weights": (16 * 8 + 16) * 2,             # layer 0's fp16 copy
        "gradients": params * fp32,
        "ddp_buckets": params * fp32,
        "optimizer_state": 2 * params * fp32,                    # Adam: two moments
        # saved at batch 4: layer 0 its fp16 input (4x8), the ReLU (follows fp16) its
        # output (4x16), layer 1 its fp32 input (4x16)
        "activations": 4 * 8 * 2 + 4 * 16 * 2 + 4 * 16 * fp32,
        # largest backward transient: layer 1's output grad (4x4) + input grad (4x16), fp32
        "workspace": (4 * 4 + 4 * 16) * fp32,
    }
    assert sim.memory_breakdown.loc[1].to_dict() == pytest.approx(expected_t4)
    assert sim.peak_memory_bytes[1] == pytest.approx(sum(expected_t4.values()))
    v100 = sim.memory_breakdown.loc[0]
    assert v100["low_precision_weights"] == 0
    assert v100["activations"] == (4 * 8 + 4 * 16 + 4 * 16) * fp32


@pytest.mark.parametrize("optimizer, states", [("sgd", 0), ("sgd_momentum", 1), ("adamw", 2)])
def test_optimizer_state(graph, make_cluster, optimizer, states):
    sim = simulate(graph, {}, make_cluster([FAST]), CostModel(), optimizer=optimizer)
    assert sim.memory_breakdown.loc[0, "optimizer_state"] == states * graph.params["bytes"].sum()
