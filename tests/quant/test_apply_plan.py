"""apply_plan_ and describe_precisions on zoo models: identity, mixed plans, errors, state_dict."""

import copy
import itertools

import pytest
import torch
from torch import nn

from qsync_lab.errors import QSyncError
from qsync_lab.models import example_batch, get_model, model_spec
from qsync_lab.quant import (
    QConv2d,
    QEmbedding,
    QLinear,
    QMatMul,
    apply_plan_,
    describe_precisions,
)

BERT_SMALL = dict(num_layers=1, hidden=32, heads=2, intermediate=64, vocab_size=100,
                  max_positions=32, seq_len=16)
ZOO = {
    "digits_cnn": {},
    "resnet18": dict(num_classes=10, image_size=32),
    "bert_mini": BERT_SMALL,
}
GEMM_CYCLE = ["int8", "fp16", "bf16", "tf32", "fp8_e4m3",
              {"forward": "int8", "rounding": "stochastic", "granularity": "channel"},
              {"forward": "int8", "backward": "bf16"}]
BOUNDARY_CYCLE = ["fp16", "bf16", "fp32"]


def _model(name):
    torch.manual_seed(0)
    return get_model(name, **ZOO[name])


def _loss_and_grads(name, model):
    inputs, target = example_batch(name, 2, seed=1, **ZOO[name])
    loss = model_spec(name).loss_fn()(model(*inputs), target)
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _mixed_plan(model):
    table = describe_precisions(model)
    gemm = itertools.cycle(GEMM_CYCLE)
    boundary = itertools.cycle(BOUNDARY_CYCLE)
    norm_kinds = ("batch_norm", "layer_norm")
    return {fqn: next(boundary) if kind in norm_kinds else next(gemm)
            for fqn, kind in table["kind"].items()}


@pytest.mark.parametrize("name", list(ZOO))
def test_all_fp32_plan_is_bit_identical(name):
    model = _model(name)
    model.eval()  # dropout off, so two runs compare
    reference = copy.deepcopy(model)
    apply_plan_(model, {fqn: "fp32" for fqn in describe_precisions(model).index})
    ref_loss, ref_grads = _loss_and_grads(name, reference)
    loss, grads = _loss_and_grads(name, model)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())


def test_returning_to_fp32_restores_the_plain_modules():
    model = _model("bert_mini")
    model.eval()
    reference = copy.deepcopy(model)
    apply_plan_(model, _mixed_plan(model))
    apply_plan_(model, {fqn: "fp32" for fqn in describe_precisions(model).index})
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    ref_loss, _ = _loss_and_grads("bert_mini", reference)
    assert torch.equal(_loss_and_grads("bert_mini", model)[0], ref_loss)


@pytest.mark.parametrize("name", list(ZOO))
def test_mixed_plan_trains_every_parameter(name):
    model = _model(name)
    plan = _mixed_plan(model)
    apply_plan_(model, plan)
    loss, grads = _loss_and_grads(name, model)
    assert torch.isfinite(loss)
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
               for g in grads.values())
    table = describe_precisions(model)
    for fqn, value in plan.items():
        forward = value["forward"] if isinstance(value, dict) else value
        assert table.loc[fqn, "forward"] == forward


def test_mixed_plan_swaps_gemm_modules_and_keeps_parameters():
    model = _model("bert_mini")
    params = dict(model.named_parameters())
    apply_plan_(model, {fqn: "int8" for fqn, kind in describe_precisions(model)["kind"].items()
                        if kind in ("linear", "matmul", "embedding")})
    kinds = {type(m) for m in model.modules()}
    assert {QLinear, QMatMul, QEmbedding} <= kinds and nn.Linear not in kinds
    assert all(p is params[n] for n, p in model.named_parameters())


def test_describe_precisions_lists_settable_ops_with_their_config():
    model = _model("digits_cnn")
    apply_plan_(model, {"conv2": {"forward": "int8", "backward": "bf16", "rounding": "stochastic",
                                  "granularity": "channel"}, "bn1": "fp16"})
    table = describe_precisions(model)
    assert list(table.columns) == ["kind", "forward", "backward", "rounding", "granularity"]
    assert list(table.index) == ["conv1", "bn1", "conv2", "bn2", "fc1", "fc2"]
    assert table.loc["conv2"].tolist() == ["conv2d", "int8", "bf16", "stochastic", "channel"]
    assert table.loc["bn1"].tolist() == ["batch_norm", "fp16", "fp16", "nearest", "tensor"]
    assert table.loc["fc1"].tolist() == ["linear", "fp32", "fp32", "nearest", "tensor"]
    assert isinstance(model.conv2, QConv2d)


@pytest.mark.parametrize("plan, device, message", [
    ({"fc3": "int8"}, None, "unknown op FQN 'fc3'"),
    ({"fc3": "int8"}, None, "did you mean 'fc[12]'"),
    ({"fc1": "bf16"}, "T4", "op 'fc1': T4 does not support bf16"),
    ({"conv1": "int8"}, "V100-SXM2-32GB", "op 'conv1': V100-SXM2-32GB does not support int8"),
    ({"fc2": "fp8_e4m3"}, "A100-SXM4-80GB", "A100-SXM4-80GB does not support fp8_e4m3"),
    ({"bn1": "int8"}, None, "op 'bn1': batch_norm ops cannot run int8; they take fp32, bf16, fp16"),
    ({"relu1": "fp16"}, None, "op 'relu1': activation ops follow their inputs' precision"),
    ({"pool": "fp16"}, None, "op 'pool': pool ops follow their inputs' precision"),
    ({"flatten": "fp16"}, None, "op 'flatten': view ops follow"),
    ({"bn1": "tf32"}, None, "op 'bn1': batch_norm ops cannot run tf32"),
    ({"fc1.add": "fp16"}, None, "unknown op FQN 'fc1.add'"),
    ({"fc1": "int4"}, None, "op 'fc1': unknown precision 'int4'"),
    ({"fc1": {"forward": "fp16", "rounding": "stochastic"}}, None, "applies to int8 operators"),
    ({"fc1": {"forward": "int8", "backward": "int8"}}, None, "backward precision int8"),
    ({"fc1": {"forward": "int8", "scale": "x"}}, None, "needs key 'forward'"),
])
def test_bad_plans_raise_one_line_errors_and_change_nothing(plan, device, message):
    model = _model("digits_cnn")
    plan = {"fc2": "fp16", **plan}
    with pytest.raises(QSyncError, match=message) as info:
        apply_plan_(model, plan, device=device)
    assert "\n" not in str(info.value)
    assert (describe_precisions(model)["forward"] == "fp32").all()


def test_layer_norm_int8_and_dropout_are_refused_on_bert():
    model = _model("bert_mini")
    ln = "bert.encoder.layer.0.attention.output.LayerNorm"
    with pytest.raises(QSyncError, match=f"op '{ln}': layer_norm ops cannot run int8"):
        apply_plan_(model, {ln: "int8"})
    with pytest.raises(QSyncError, match="dropout ops follow their inputs' precision"):
        apply_plan_(model, {"bert.embeddings.dropout": "fp16"})
    with pytest.raises(QSyncError, match="BertEncoder container, not an operator"):
        apply_plan_(model, {"bert.encoder": "fp16"})


def test_a_functional_op_the_forward_never_calls_fails_the_first_forward():
    model = _model("digits_cnn")
    apply_plan_(model, {"matmul": "fp16"})  # a name a functional call could have
    x = example_batch("digits_cnn", 2)[0][0]
    with pytest.raises(QSyncError, match="sets functional op 'matmul', which the model's "
                       "forward did not call"):
        model(x)


def test_device_spec_allows_what_it_supports():
    model = _model("digits_cnn")
    apply_plan_(model, {"conv1": "int8", "fc1": "fp16", "bn1": "fp16"}, device="T4")
    apply_plan_(model, {"fc2": "fp8_e4m3", "conv2": "bf16"}, device="cpu")
    assert describe_precisions(model).loc[["conv1", "fc2"], "forward"].tolist() == [
        "int8", "fp8_e4m3"]


@pytest.mark.parametrize("fqn, kind", [("bert.embeddings.word_embeddings", "embedding"),
                                       ("bert.embeddings.LayerNorm", "layer_norm")])
def test_tf32_is_refused_on_ops_without_a_gemm(fqn, kind):
    model = _model("bert_mini")
    with pytest.raises(QSyncError, match=f"op '{fqn}': {kind} ops cannot run tf32"):
        apply_plan_(model, {fqn: "tf32"})
    assert type(model.bert.embeddings.word_embeddings) is nn.Embedding


@pytest.mark.parametrize("name", ["digits_cnn", "bert_mini"])
def test_state_dict_loads_both_ways(name):
    plain, planned = _model(name), _model(name)
    apply_plan_(planned, _mixed_plan(planned))
    assert list(planned.state_dict()) == list(plain.state_dict())
    torch.manual_seed(5)
    donor = get_model(name, **ZOO[name])
    planned.load_state_dict(donor.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(planned.state_dict().values(),
                                                 donor.state_dict().values()))
    for p in planned.parameters():
        p.data.add_(1.0)
    plain.load_state_dict(planned.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                 planned.state_dict().values()))


def test_planned_model_deepcopies_and_pickles(tmp_path):
    model = _model("digits_cnn")
    model.eval()
    apply_plan_(model, {"conv1": "int8", "bn1": "fp16", "fc2": "bf16"})
    x = example_batch("digits_cnn", 4, seed=2)[0][0]
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert torch.equal(loaded(x), model(x))
    assert torch.equal(copy.deepcopy(model)(x), model(x))


def test_none_leaves_an_op_alone():
    layer = nn.Linear(4, 4)
    apply_plan_(layer, {"": None})
    assert type(layer) is nn.Linear
