"""Peak memory against a hand count on a 2-layer model."""

import pytest
import torch
import torch.nn as nn
from tests.simulate.conftest import FAST, SLOW

from qsync_lab.costs import CostModel
from qsync_lab.graph import trace_graph
from qsync_lab.simulate import simulate


def _two_layers():
    # Linear(8, 16) -> ReLU -> Linear(16, 4), traced at batch 2
    return trace_graph(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                       torch.randn(2, 8))


def _peak_moment(moments: dict[str, dict[str, int]]) -> dict[str, int]:
    """The backward moment (op -> held activations, gradients, workspace) with most bytes."""
    return max(moments.values(), key=lambda held: sum(held.values()))


def test_memory_equals_hand_count_on_two_layers(make_cluster):
    sim = simulate(_two_layers(), {SLOW: {"0": "fp16"}}, make_cluster([FAST, SLOW], [4, 4]),
                   CostModel(), optimizer="adam")
    params = (16 * 8 + 16) + (4 * 16 + 4)  # 212 elements
    fp32, fp16 = 4, 2
    grad0, grad1 = (16 * 8 + 16) * fp32, (4 * 16 + 4) * fp32
    # T4 at batch 4: layer 0 saves its fp16 input (4x8), the ReLU its output (4x16) in fp32
    # (the runtime rounds values, not storage, between ops), layer 1 its fp32 input (4x16);
    # backward runs layer 1, ReLU, layer 0, each holding its output grad + input grad at
    # its backward precision (the ReLU follows layer 0: fp16)
    saved = {"0": 4 * 8 * fp16, "1": 4 * 16 * fp32, "2": 4 * 16 * fp32}
    moments = {
        "2": {"activations": saved["0"] + saved["1"] + saved["2"], "gradients": grad1,
              "workspace": (4 * 4 + 4 * 16) * fp32},
        "1": {"activations": saved["0"] + saved["1"], "gradients": grad1,
              "workspace": (4 * 16 + 4 * 16) * fp16},
        "0": {"activations": saved["0"], "gradients": grad0 + grad1,
              "workspace": (4 * 16 + 4 * 8) * fp16},
    }
    expected_t4 = {
        "master_weights": params * fp32,
        "low_precision_weights": (16 * 8 + 16) * fp16,          # layer 0's fp16 copy
        "ddp_buckets": params * fp32,
        "optimizer_state": 2 * params * fp32,                    # Adam: two moments
        **_peak_moment(moments),                                 # layer 1's backward
    }
    assert _peak_moment(moments) == moments["2"]
    assert sim.memory_breakdown.loc[1].to_dict() == pytest.approx(expected_t4)
    assert sim.tensor_peak_bytes[1] == pytest.approx(sum(expected_t4.values()))
    v100 = sim.memory_breakdown.loc[0]
    assert v100["low_precision_weights"] == 0
    assert v100["activations"] == 4 * 8 * fp32                  # peak at layer 0 again
    assert v100["gradients"] == grad0 + grad1


def test_activation_heavy_batch_peaks_at_the_start_of_backward(make_cluster):
    batch = 4096  # activations dwarf the 848 gradient bytes
    sim = simulate(_two_layers(), {}, make_cluster([FAST], [batch]), CostModel(),
                   optimizer="sgd")
    held = sim.memory_breakdown.loc[0]
    assert held["activations"] == batch * (8 + 16 + 16) * 4     # everything saved
    assert held["gradients"] == (4 * 16 + 4) * 4                # only layer 1's grads yet
    assert held["workspace"] == batch * (4 + 16) * 4


@pytest.mark.parametrize("optimizer, states", [("sgd", 0), ("sgd_momentum", 1), ("adamw", 2)])
def test_optimizer_state(graph, make_cluster, optimizer, states):
    sim = simulate(graph, {}, make_cluster([FAST]), CostModel(), optimizer=optimizer)
    assert sim.memory_breakdown.loc[0, "optimizer_state"] == states * graph.params["bytes"].sum()
