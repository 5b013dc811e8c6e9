"""The end of a step with a loss scaler (CPU's GradScaler stands in for CUDA's): an fp16
overflow is skipped and halves the scale, a non-finite loss is reported, a finite step
steps; and which models get an enabled scaler."""

import math

import torch
from torch import nn

from qsync_lab.quant import apply_plan_
from qsync_lab.runtime.optimizer_step import (finish_step, first_nonfinite_gradient, loss_scaler,
                                              needs_loss_scaling)


def _step(loss_value: float, grad_value: float):
    layer = nn.Linear(2, 1)
    before = layer.weight.detach().clone()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    loss = layer(torch.ones(1, 2)).sum() * 0 + loss_value
    scaler.scale(loss).backward()
    layer.weight.grad.fill_(grad_value)
    found = finish_step(loss, optimizer, scaler, layer)
    return found, scaler.get_scale(), torch.equal(layer.weight, before)


def test_an_overflow_with_a_finite_loss_is_skipped_and_halves_the_scale():
    found, scale, unchanged = _step(1.0, math.inf)
    assert found is None and scale == 2.0**9 and unchanged


def test_a_non_finite_loss_is_reported():
    found, _, unchanged = _step(math.nan, math.nan)
    assert found == "weight" and unchanged


def test_a_finite_step_steps():
    found, scale, unchanged = _step(1.0, 0.5)
    assert found is None and scale == 2.0**10 and not unchanged


def test_only_fp16_gradients_on_cuda_need_loss_scaling():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    assert not needs_loss_scaling(model, cuda=True)
    apply_plan_(model, {"0": "bf16"})
    assert not needs_loss_scaling(model, cuda=True)
    apply_plan_(model, {"1": "int8"})  # int8 forward, fp16 backward
    assert needs_loss_scaling(model, cuda=True)
    assert not needs_loss_scaling(model, cuda=False)  # the CPU emulation stays exact
    assert not loss_scaler(model, cuda=False).is_enabled()


def test_the_first_parameter_with_a_non_finite_gradient_is_named():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model(torch.ones(1, 2)).sum().backward()
    assert first_nonfinite_gradient(model) is None
    model[1].bias.grad.fill_(math.inf)
    assert first_nonfinite_gradient(model) == "1.bias"
