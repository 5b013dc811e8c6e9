"""Training with an all-int8 plan: digits_cnn on the digits split matches fp32 accuracy."""

import pytest
import torch

from qsync_lab.datasets import load_digits_split
from qsync_lab.models import get_model
from qsync_lab.quant import apply_plan_

STEPS = 100
BATCH = 64
ALL_INT8 = {fqn: "int8" for fqn in ("conv1", "conv2", "fc1", "fc2")}


def _train(plan, data, seed=0):
    """Seeded SGD run; returns (test accuracy, {param: gradient of the last step})."""
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(seed)
    model = get_model("digits_cnn")
    apply_plan_(model, plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    order = torch.Generator().manual_seed(seed)
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(STEPS):
        batch = torch.randint(0, len(x_train), (BATCH,), generator=order)
        optimizer.zero_grad()
        loss_fn(model(x_train[batch]), y_train[batch]).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    return accuracy, grads


@pytest.fixture(scope="module")
def digits():
    return load_digits_split(seed=0)


def test_all_int8_plan_matches_fp32_accuracy(digits):
    fp32_accuracy, _ = _train({}, digits)
    int8_accuracy, grads = _train(ALL_INT8, digits)
    print(f"test accuracy after {STEPS} steps: fp32 {fp32_accuracy:.4f}, int8 {int8_accuracy:.4f}")
    assert fp32_accuracy > 0.9
    assert abs(int8_accuracy - fp32_accuracy) <= 0.02
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values()), \
        [n for n, g in grads.items() if not g.abs().sum() > 0]
