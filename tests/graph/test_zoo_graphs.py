import pytest
import torch

from qsync_lab.graph import trace_graph
from qsync_lab.models import example_batch, get_model, list_models, model_spec

#: small data shapes keep the (fake-tensor) trace quick; model sizes stay as published
DATA = {"resnet18": {"image_size": 64}, "resnet50": {"image_size": 64},
        "vgg16_bn": {"image_size": 32}, "bert_base": {"seq_len": 32},
        "bert_mini": {"seq_len": 32}}


@pytest.mark.parametrize("name", list_models())
def test_every_zoo_model_traces_with_fx_and_covers_every_parameter(name):
    model = get_model(name)
    inputs, target = example_batch(name, 2, **DATA.get(name, {}))
    g = trace_graph(model, inputs, target=target, loss_fn=model_spec(name).loss_fn())
    assert g.traced_with == "fx"
    assert not g.ops.index.duplicated().any()
    assert g.totals()["param_count"] == sum(p.numel() for p in model.parameters())
    assert g.params["first_op"].notna().all(), "a parameter no op reads"
    assert g.ops["kind"].iloc[-1] == "loss"
    assert (g.ops["kind"] != "other").all(), g.ops[g.ops["kind"] == "other"]
    assert g.ops["depth"].max() == g.ops.loc[g.ops.index[-1], "depth"]  # loss is deepest


def test_bert_graph_names_each_attention_matmul():
    g = trace_graph(get_model("bert_mini"), example_batch("bert_mini", 2, seq_len=16)[0])
    matmuls = g.ops.index[g.ops["kind"] == "matmul"]
    assert len(matmuls) == 2 * 4  # two per layer, four layers
    assert "bert.encoder.layer.0.attention.self.score_matmul" in matmuls
    score = g.ops.loc["bert.encoder.layer.0.attention.self.score_matmul"]
    assert score["input_shapes"] == ((2, 4, 16, 64), (2, 4, 64, 16))


def test_resnet50_multiply_adds_match_the_published_figure():
    # ResNet-50 at 224x224 is ~4.1 G multiply-adds per image (convolutions + fc; the
    # commonly quoted "3.8-4.1 GFLOPs" count multiply-adds). Our FLOPs are 2 per MAC plus
    # one per bias element (only the fc has a bias: 1000 outputs).
    g = trace_graph(get_model("resnet50"), torch.randn(1, 3, 224, 224))
    conv_flops = g.ops.loc[g.ops["kind"] == "conv2d", "fwd_flops"].sum()
    fc_flops = g.ops.loc[g.ops["kind"] == "linear", "fwd_flops"].sum()
    macs = conv_flops / 2 + (fc_flops - 1000) / 2
    assert fc_flops - 1000 == 2 * 2048 * 1000
    assert 4.05e9 < macs < 4.15e9
