"""What the graph counts for user-style models of six families and the zoo, against torch:
GEMM-like FLOPs (``torch.utils.flop_counter`` on meta tensors, forward and backward) and
the activations autograd saves (``saved_tensors_hooks``)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from qsync_lab.graph import trace_graph
from qsync_lab.graph.kinds import COUNTED_KINDS
from qsync_lab.models import example_batch, get_model, list_models, model_spec
from qsync_lab.models.families import FAMILIES, family_batch, family_model

from tests.graph.test_opgraph import autograd_saved_bytes
from tests.graph.test_zoo_graphs import DATA

#: the kinds whose FLOPs torch's counter counts too (it leaves element-wise math out)
GEMM_LIKE = frozenset({"linear", "conv1d", "conv2d", "conv3d", "matmul"}) | COUNTED_KINDS


def _meta(value):
    return torch.empty(value.shape, dtype=value.dtype, device="meta")


def _conv_backward_flops(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding,
                         _dilation, transposed, _output_padding, _groups, output_mask,
                         out_shape=None) -> int:
    """Each gradient a convolution computes costs its forward. Torch's own formula ignores
    ``groups`` (it counts a 32-channel depthwise 3x3 conv's backward 33x its forward)."""
    once = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return once * (int(output_mask[0]) + int(output_mask[1]))


def torch_counted_flops(model: nn.Module, inputs, target, loss_fn) -> tuple[int, int]:
    """(forward, backward) FLOPs of one training step, counted by torch on meta tensors."""
    meta_model = copy.deepcopy(model).to("meta")
    with FlopCounterMode(display=False) as forward:
        out = meta_model(*[_meta(t) for t in inputs])
    loss = loss_fn(out, _meta(target))
    with FlopCounterMode(display=False, custom_mapping={
            torch.ops.aten.convolution_backward: _conv_backward_flops}) as backward:
        loss.backward()
    return forward.get_total_flops(), backward.get_total_flops()


def graph_flops(model, inputs, target, loss_fn) -> tuple[int, int, object]:
    g = trace_graph(model, inputs, target=target, loss_fn=loss_fn)
    gemm = g.ops[g.ops["kind"].isin(GEMM_LIKE)]
    return (int(gemm["fwd_flops"].sum()),
            int((gemm["bwd_input_flops"] + gemm["bwd_weight_flops"]).sum()), g)


def _check(model, inputs, target, loss_fn):
    ours_fwd, ours_bwd, g = graph_flops(model, inputs, target, loss_fn)
    ref_fwd, ref_bwd = torch_counted_flops(model, inputs, target, loss_fn)
    assert ref_fwd > 0 and ref_bwd > 0
    # ours adds one FLOP per bias element; torch's addmm counts none
    assert 0.95 <= ours_fwd / ref_fwd <= 1.05, (ours_fwd, ref_fwd)
    assert 0.9 <= ours_bwd / ref_bwd <= 1.1, (ours_bwd, ref_bwd)
    return g


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_user_model_flops_match_torchs_counter(name):
    torch.manual_seed(0)
    inputs, target = family_batch(name, 2)
    g = _check(family_model(name), inputs, target, FAMILIES[name].loss_fn())
    assert g.totals()["param_count"] == sum(p.numel() for p in family_model(name).parameters())


#: the saved-activation check runs the models for real: the large two are left out
SMALL_ZOO = [n for n in list_models() if n not in ("bert_base", "resnet50")]


@pytest.mark.parametrize("name", list_models())
def test_zoo_model_flops_match_torchs_counter(name):
    inputs, target = example_batch(name, 2, **DATA.get(name, {}))
    _check(get_model(name), inputs, target, model_spec(name).loss_fn())


@pytest.mark.parametrize("name", [*sorted(FAMILIES), *SMALL_ZOO])
def test_saved_activations_match_what_autograd_keeps(name):
    torch.manual_seed(0)
    if name in FAMILIES:
        model, (inputs, target) = family_model(name), family_batch(name, 8)
        loss_fn = FAMILIES[name].loss_fn()
    else:
        model, loss_fn = get_model(name), model_spec(name).loss_fn()
        inputs, target = example_batch(name, 8, **DATA.get(name, {}))
    g = trace_graph(model, inputs, target=target, loss_fn=loss_fn)
    measured = autograd_saved_bytes(model, inputs, target, loss_fn)
    assert g.saved_activation_bytes("cpu") == pytest.approx(measured, rel=0.07)


def test_attention_recurrent_and_transformer_layers_are_ops_of_their_kind():
    fast_path = torch.backends.mha.get_fastpath_enabled()
    g = trace_graph(family_model("vit"), family_batch("vit", 2)[0])
    assert g.traced_with == "fx"  # nn.TransformerEncoder traced without its fast path
    assert torch.backends.mha.get_fastpath_enabled() == fast_path
    assert nn.modules.transformer._get_seq_len(torch.zeros(2, 5, 3), True) == 5  # restored
    assert (g.ops["kind"] != "other").all(), g.ops[g.ops["kind"] == "other"]["target"]
    assert (g.ops["kind"] == "attention").sum() == 2  # one MultiheadAttention per layer
    # each layer's in- and out-projection and FFN, the head
    assert (g.ops["kind"] == "linear").sum() == 2 * 4 + 1
    lstm = trace_graph(family_model("lstm_tagger"), family_batch("lstm_tagger", 2)[0])
    assert lstm.ops.loc["lstm", "kind"] == "recurrent"
    gpt = trace_graph(family_model("gpt_decoder"), family_batch("gpt_decoder", 2)[0])
    sdpa = gpt.ops[gpt.ops["kind"] == "attention"]
    assert list(sdpa.index) == ["blocks.0.scaled_dot_product_attention",
                                "blocks.1.scaled_dot_product_attention"]
    b, h, t, d = 2, 4, 32, 16  # two GEMMs of (t x d) by (d x t), per batch and head
    assert (sdpa["fwd_flops"] == 2 * 2 * b * h * t * t * d).all()
    assert (sdpa["bwd_input_flops"] == 2 * sdpa["fwd_flops"]).all()


@pytest.mark.parametrize("method", ["fx", "hooks"])
def test_both_tracers_count_attention_and_transposed_convolutions(method):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.ConvTranspose2d(4, 2, 3, stride=2)
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x, seq):
            y = torch.einsum("bij,bjk->bik", seq, seq.transpose(1, 2))
            return self.up(x).sum() + self.mha(seq, seq, seq)[0].sum() + y.sum()

    x, seq = torch.randn(2, 4, 5, 5), torch.randn(2, 6, 8)
    ops = trace_graph(Net(), (x, seq), method=method).ops
    assert ops.loc["up", "fwd_flops"] == 2 * 2 * 4 * 2 * 9 * 25  # every input pixel x kernel
    assert ops.loc["up", "kind"] == "conv_transpose"
    assert ops.loc["einsum", "fwd_flops"] == 2 * 2 * 6 * 8 * 6
    projection, scores = 2 * 2 * 6 * 8 * 8, 2 * 2 * 2 * 6 * 6 * 8  # each, and both bmm
    bias = 2 * 6 * 8
    assert ops.loc["mha.in_proj", "fwd_flops"] == 3 * (projection + bias)
    assert ops.loc["mha", "fwd_flops"] == scores  # nn.MultiheadAttention as three ops
    assert ops.loc["mha.out_proj", "fwd_flops"] == projection + bias
    assert ops.loc["mha", "bwd_weight_flops"] == 0


def test_a_call_without_a_meta_kernel_is_uncounted_not_an_error():
    from qsync_lab.graph.flop_count import counted_forward_flops

    def data_dependent(x):
        return x[x > 0] @ torch.ones(1)  # the shape depends on the values

    assert counted_forward_flops(data_dependent, (torch.randn(3, 1),), {}) is None
    assert counted_forward_flops(F.linear, (torch.randn(3, 4), torch.randn(5, 4)), {}) == 120


class _BatchModel(nn.Module):
    """Called as ``model(**batch)`` and returning a dict, as Hugging Face-style models are."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 3)

    def forward(self, input_ids, attention_mask=None, labels=None):
        x = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        return {"logits": self.head(x.mean(dim=1)), "hidden": x}


class _LogitsLoss(nn.Module):
    def forward(self, out, target):
        return F.cross_entropy(out["logits"], target)


@pytest.mark.parametrize("method", ["fx", "hooks"])
def test_a_model_called_with_a_dict_batch_and_returning_a_dict_traces(method):
    batch = {"attention_mask": torch.ones(4, 7), "input_ids": torch.randint(0, 50, (4, 7))}
    g = trace_graph(_BatchModel(), batch, target=torch.tensor([0, 1, 2, 0]),
                    loss_fn=_LogitsLoss(), method=method)
    assert {"embed", "head"} <= set(g.ops.index) and g.ops["kind"].iloc[-1] == "loss"
    assert g.ops.loc["embed", "input_shapes"] == ((4, 7),)  # input_ids, whatever the dict order
    assert g.ops.loc["head", "fwd_flops"] == 2 * 4 * 16 * 3 + 4 * 3
    assert g.totals()["param_count"] == 50 * 16 + 16 * 3 + 3


def test_a_dict_batch_key_must_be_an_argument_name():
    from qsync_lab.errors import QSyncError

    with pytest.raises(QSyncError, match="'input ids' is not a Python identifier"):
        trace_graph(_BatchModel(), {"input ids": torch.zeros(1, 2, dtype=torch.long)})
