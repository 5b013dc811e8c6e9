"""In-step op timing: every op's forward and backward time lands on that op, and only there
(sleeps of known length as the ground truth; lower bounds, so machine load cannot fail them)."""

import time

import pytest
import torch
from torch import nn

from qsync_lab.errors import QSyncError
from qsync_lab.profile import profile_ops
from qsync_lab.profile.in_step import time_ops_in_steps
from qsync_lab.quant import native
from qsync_lab.quant.native import set_tf32

SLEEP_S = 0.03
SLEEP_US = SLEEP_S * 1e6


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        time.sleep(SLEEP_S)
        return grad * 2


class SlowBackward(nn.Module):
    """An op (its own kind) whose backward node sleeps."""

    op_kind = "activation"

    def forward(self, x):
        return _SlowBackward.apply(x)


class SlowForward(nn.Module):
    op_kind = "activation"

    def forward(self, x):
        time.sleep(SLEEP_S)
        return x * 3


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), SlowForward(), nn.Linear(8, 8), SlowBackward(),
                         nn.Linear(8, 3))


def _batch():
    return (torch.randn(4, 8),), torch.tensor([0, 1, 2, 0])


def test_each_ops_time_lands_on_that_op():
    inputs, target = _batch()
    t = time_ops_in_steps(_model(), inputs, target, nn.CrossEntropyLoss(), "fp32", steps=5,
                          warmup=1)
    assert len(t.forward_us) == len(t.backward_us) == 6  # five layers and the loss
    slow_forward = [i for i, us in enumerate(t.forward_us) if us >= SLEEP_US]
    slow_backward = [i for i, us in enumerate(t.backward_us) if us >= SLEEP_US]
    assert slow_forward == [1] and slow_backward == [3]
    assert t.backward_us[0] > 0  # the first Linear's weight gradient (its input needs none)


def test_gradient_accumulation_hooks_are_not_an_ops_backward():
    """DDP's reducer runs in hooks after a parameter's gradient is accumulated: that time
    belongs to DDP (simulated separately), never to the op."""
    model = _model()
    model[4].weight.register_post_accumulate_grad_hook(lambda p: time.sleep(SLEEP_S))
    inputs, target = _batch()
    t = time_ops_in_steps(model, inputs, target, nn.CrossEntropyLoss(), "fp32", steps=5,
                          warmup=1)
    assert [i for i, us in enumerate(t.backward_us) if us >= SLEEP_US] == [3]


def test_precisions_are_set_where_ops_take_them_and_the_model_is_untouched():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    before = [p.detach().clone() for p in model.parameters()]
    inputs, target = _batch()
    t = time_ops_in_steps(model, inputs, target, nn.CrossEntropyLoss(), "int8", steps=1,
                          warmup=0)
    assert t.effective == ["int8", "fp32", "int8", "fp32"]  # ReLU and the loss refuse int8
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert type(model[0]) is nn.Linear


class SwitchProbe(nn.Module):
    """An op that records whether cuBLAS's TF32 switch is on when it runs (in ``seen``,
    shared by the copies the profiler makes)."""

    op_kind = "activation"
    seen: set = set()

    def forward(self, x):
        SwitchProbe.seen.add(torch.backends.cuda.matmul.allow_tf32)
        return x * 1


def test_steps_run_under_the_tf32_switches_of_a_uniform_plans_rank():
    """A tf32 run keeps TF32 on throughout its steps (as a rank running the tf32 plan): an
    op between the GEMMs sees it on; other precisions run with it off; restored after."""
    inputs, target = _batch()
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    set_tf32(False)
    try:
        seen = {}
        for precision in ("fp32", "bf16", "tf32"):
            model = nn.Sequential(nn.Linear(8, 8), SwitchProbe(), nn.Linear(8, 3))
            SwitchProbe.seen = set()
            t = time_ops_in_steps(model, inputs, target, nn.CrossEntropyLoss(), precision,
                                  steps=1, warmup=0)
            assert t.effective[0] == precision
            seen[precision] = SwitchProbe.seen
        assert seen == {"fp32": {False}, "bf16": {False}, "tf32": {True}}
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("method", ["in_step", "isolated"])
def test_tf32_ops_are_profiled_as_a_rank_that_keeps_tf32_on_runs_them(method, monkeypatch):
    """Natively, a profiled tf32 op runs as the plain torch call (TF32 kept on): the path
    that switches around a single op is never taken."""
    inputs, target = _batch()
    monkeypatch.setattr(native, "_tf32_switched", None)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    set_tf32(False)
    try:
        with native.execution("native"):
            rows = profile_ops(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)),
                               inputs, target, nn.CrossEntropyLoss(), ["tf32"], repeats=1,
                               warmup=0, method=method, progress=False)
        assert set(rows.loc[rows["kind"] == "linear", "precision"]) >= {"tf32"}
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_in_step_rows_have_the_isolated_rows_keys_and_split_the_backward():
    inputs, target = _batch()
    args = (_model(), inputs, target, nn.CrossEntropyLoss(), ["fp32", "bf16"])
    keys = ["op", "kind", "shape_key", "precision", "plan_precision", "phase"]
    in_step = profile_ops(*args, repeats=2, warmup=1, method="in_step", progress=False)
    isolated = profile_ops(*args, repeats=2, warmup=1, method="isolated", progress=False)
    assert in_step[keys].sort_values(keys).values.tolist() == \
        isolated[keys].sort_values(keys).values.tolist()
    fp32 = in_step[in_step["plan_precision"] == "fp32"].set_index(["op", "phase"])
    us = fp32["time_us"]
    assert us[("3", "backward_input")] >= SLEEP_US and us[("1", "forward")] >= SLEEP_US
    # a Linear's backward is split in proportion to the phases' FLOPs
    ratio = us[("2", "backward_input")] / us[("2", "backward_weight")]
    flops = fp32["flops"]
    assert ratio == pytest.approx(flops[("2", "backward_input")] / flops[("2", "backward_weight")])


def test_bad_arguments_are_one_line_errors():
    inputs, target = _batch()
    with pytest.raises(QSyncError, match="steps must be >= 1"):
        time_ops_in_steps(_model(), inputs, target, nn.CrossEntropyLoss(), "fp32", steps=0)
    with pytest.raises(QSyncError, match="unknown profiling method"):
        profile_ops(_model(), inputs, target, nn.CrossEntropyLoss(), ["fp32"], method="fast")
