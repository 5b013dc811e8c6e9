"""Modules judged by what they compute: a transposed-weight linear map and an RMS norm of
their own classes are planned, traced and run like ``nn.Linear`` and ``nn.RMSNorm``."""

import torch
from torch import nn

from qsync_lab.graph import trace_graph
from qsync_lab.policy.evidence import computed_kind, linear_layout, linear_weight
from qsync_lab.quant import apply_plan_


class Conv1D(nn.Module):
    """GPT-2's projection: weight (in, out), ``addmm``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in**0.5)
        self.bias = nn.Parameter(torch.randn(n_out))

    def forward(self, x):
        out = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], -1)


class ScaleNorm(nn.Module):
    """T5's layer norm: an RMS norm with a scale and no bias."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + torch.randn(width) / 10)
        self.variance_epsilon = 1e-6

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


class LayerScale(nn.Module):
    """A 1-d weight that scales, and does not normalise."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((width,), 0.1))

    def forward(self, x):
        return x * self.weight


def test_what_each_module_computes_is_found():
    assert (computed_kind(Conv1D(6, 4)), linear_layout(Conv1D(6, 4))) == ("linear", "transposed")
    assert (computed_kind(Conv1D(4, 4)), linear_layout(Conv1D(4, 4))) == ("linear", "transposed")
    assert computed_kind(ScaleNorm(8)) == "rms_norm"
    assert computed_kind(LayerScale(8)) is None
    layer = Conv1D(6, 4)
    assert torch.equal(linear_weight(layer), layer.weight.t())


def test_the_probe_leaves_the_global_random_state_alone():
    layer = Conv1D(6, 4)
    state = torch.random.get_rng_state()
    computed_kind(layer)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_transposed_linear_runs_a_plan_as_nn_linear_does():
    torch.manual_seed(0)
    ours = Conv1D(16, 8)
    reference = nn.Linear(16, 8)
    with torch.no_grad():
        reference.weight.copy_(ours.weight.t())
        reference.bias.copy_(ours.bias)
    x = torch.randn(3, 5, 16)
    for precision in ("int8", "bf16", "fp8_e4m3"):
        apply_plan_(ours, {"": precision})
        apply_plan_(reference, {"": precision})
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ours(xa), reference(xb)
        assert torch.equal(ya, yb), precision
        ya.sum().backward()
        yb.sum().backward()
        assert torch.equal(xa.grad, xb.grad)
        assert torch.equal(ours.weight.grad, reference.weight.grad.t())
        ours.weight.grad = reference.weight.grad = None
    assert set(ours.state_dict()) == {"weight", "bias"}  # the same parameters, in place


def test_the_tracer_sees_them_as_one_op_each_with_the_linear_flops():
    model = nn.Sequential(Conv1D(16, 32), nn.ReLU(), ScaleNorm(32))
    ops = trace_graph(model, torch.randn(4, 16)).ops
    assert ops["kind"].tolist() == ["linear", "activation", "rms_norm"]
    assert ops.loc[["0", "2"], "plan_refusal"].tolist() == ["", ""]
    assert ops.at["0", "fwd_flops"] == 2 * 4 * 16 * 32 + 4 * 32
