"""The indicator's score of normalisation ops against an independent reference: the norm run
in fp32 against the same norm with its input and output rounded by torch casts (and its
gradients rounded on the way back), as the runtime's precision boundary does."""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from qsync_lab.allocate import op_choices
from qsync_lab.cluster import load_cluster
from qsync_lab.costs import CostModel, op_work
from qsync_lab.devices import load_catalog
from qsync_lab.graph import trace_graph
from qsync_lab.indicator import indicator
from qsync_lab.precision import Precision

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
LOSS = nn.MSELoss()


class _RoundGrad(torch.autograd.Function):
    """Identity forward; rounds the gradient flowing back to ``dtype``."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).float(), None


def _cast(t, dtype):
    """Round forward with a cast, pass the gradient straight through."""
    return t + (t.to(dtype).float() - t).detach()


def _conv_norm(norm: nn.Module, channels_last: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    channels = 16
    model = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), norm)
    with torch.no_grad():  # channels of very different scales, and a non-trivial affine
        model[0].weight.mul_(torch.exp(1.5 * torch.randn(channels, 1, 1, 1)))
        norm.weight.copy_(2 * torch.randn_like(norm.weight))
        norm.bias.copy_(torch.randn_like(norm.bias))
    batches = [(torch.randn(8, 3, 12, 12), torch.randn(8, channels, 12, 12)) for _ in range(4)]
    return model, batches


def _measured(model, batches, dtype):
    """Mean over batches of the squared error of the norm's output (forward: input and
    output rounded) and of its input and parameter gradients (both directions rounded,
    the output gradient held at its fp32 value)."""
    norm = model[1]
    fwd, bwd = [], []
    for x_in, target in batches:
        x = model[0](x_in).detach()
        x32 = x.clone().requires_grad_()
        y32 = norm(x32)
        y32.retain_grad()
        LOSS(y32, target).backward()
        ref = (x32.grad, norm.weight.grad.clone(), norm.bias.grad.clone())
        norm.zero_grad()
        xq = x.clone().requires_grad_()
        yq = _RoundGrad.apply(norm(_RoundGrad.apply(_cast(xq, dtype), dtype)), dtype)
        yq = _cast(yq, dtype)
        yq.backward(y32.grad)
        out = (xq.grad, norm.weight.grad.clone(), norm.bias.grad.clone())
        norm.zero_grad()
        fwd.append(float((yq.detach() - y32.detach()).double().square().sum()))
        bwd.append(sum(float((o - r).double().square().sum()) for o, r in zip(out, ref)))
    return np.mean(fwd), np.mean(bwd)


@pytest.mark.parametrize("norm", [lambda: nn.BatchNorm2d(16), lambda: nn.GroupNorm(4, 16)],
                         ids=["batch_norm", "group_norm"])
def test_norm_terms_predict_the_measured_rounding_error(norm):
    model, batches = _conv_norm(norm())
    graph = trace_graph(model, batches[0][0], target=batches[0][1], loss_fn=LOSS)
    scores = indicator(model, graph, batches, loss_fn=LOSS, precisions=["fp16", "bf16"],
                       num_batches=len(batches), progress=False)
    for p, dtype in DTYPES.items():
        fwd, bwd = _measured(model, batches, dtype)
        assert 0.5 < scores.at["1", (p, "V_f")] / fwd < 2.0
        assert 0.5 < scores.at["1", (p, "V_b")] / bwd < 2.0
    assert (scores.loc["1", "bf16"] > scores.loc["1", "fp16"]).all()


def test_layer_norm_forward_term_predicts_the_measured_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64))
    with torch.no_grad():
        model[1].weight.copy_(2 * torch.randn(64))
        model[1].bias.copy_(torch.randn(64))
    batches = [(torch.randn(4, 10, 32), torch.randn(4, 10, 64)) for _ in range(3)]
    graph = trace_graph(model, batches[0][0], target=batches[0][1], loss_fn=LOSS)
    scores = indicator(model, graph, batches, loss_fn=LOSS, precisions=["fp16", "bf16"],
                       num_batches=len(batches), progress=False)
    assert scores.at["1", ("op", "kind")] == "layer_norm"
    for p, dtype in DTYPES.items():
        errors = []
        for x_in, _ in batches:
            with torch.no_grad():
                x = model[0](x_in)
                y = model[1](x)
                yq = model[1](x.to(dtype).float()).to(dtype).float()
            errors.append(float((yq - y).double().square().sum()))
        assert 0.5 < scores.at["1", (p, "V_f")] / np.mean(errors) < 2.0


def test_norms_get_no_int8_fp8_or_tf32_score_and_no_int8_choice():
    model, batches = _conv_norm(nn.BatchNorm2d(16))
    graph = trace_graph(model, batches[0][0], target=batches[0][1], loss_fn=LOSS)
    scores = indicator(model, graph, batches[:1], loss_fn=LOSS,
                       precisions=["fp16", "int8", "fp8_e4m3", "tf32"], num_batches=1,
                       progress=False)
    assert scores.loc["1", ["int8", "fp8_e4m3", "tf32"]].isna().all()  # the policy's rule
    assert scores.loc["0", "int8"].notna().all()  # the conv keeps every precision
    choices = op_choices(op_work(graph), scores, load_catalog().device("T4"))
    ladders = {graph.ops.index[op]: [str(p) for p in ladder]
               for op, ladder in zip(choices.ops, choices.ladders)}
    assert ladders["1"] == ["fp16", "fp32"]
    assert ladders["0"][0] == "int8"


def test_uniform_low_precision_lowers_the_norms_to_fp16():
    from qsync_lab.allocate import uniform_low_precision
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(64, 256, 3, padding=1), nn.BatchNorm2d(256), nn.ReLU(),
                          nn.Conv2d(256, 64, 3, padding=1), nn.BatchNorm2d(64))
    x, y = torch.randn(4, 64, 32, 32), torch.randn(4, 64, 32, 32)
    graph = trace_graph(model, x, target=y, loss_fn=LOSS)
    scores = indicator(model, graph, [(x, y)], loss_fn=LOSS, precisions=["fp16", "int8"],
                       num_batches=1, progress=False)
    plan = uniform_low_precision(graph, load_cluster("v100-t4-small"), CostModel(), scores)
    t4 = {fqn: str(cfg.forward) for fqn, cfg in plan.precisions["T4"].items()}
    assert t4 == {"0": "int8", "1": "fp16", "3": "int8", "4": "fp16"}
    assert all(math.isfinite(v) for v in scores[("fp16", "omega")])
    assert Precision.FP16 in {cfg.forward for cfg in plan.precisions["T4"].values()}
