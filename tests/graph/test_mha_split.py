"""``nn.MultiheadAttention`` traced as three ops: in-projection, attention core, out-projection
(qsync_lab.graph.attention), by both tracers, with torch's FLOPs and saved activations."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from qsync_lab.graph import trace_graph
from qsync_lab.models.families import FAMILIES, MHAEncoder, family_batch, family_model

from tests.graph.test_opgraph import autograd_saved_bytes

METHODS = ["fx", "hooks"]


def _torch_flops(module: nn.Module, *args, **kwargs) -> int:
    """torch's count of one call, on meta tensors (on the CPU, fused attention counts 0)."""
    meta = copy.deepcopy(module).to("meta")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        meta(*(a.to("meta") for a in args), **kwargs)
    return counter.get_total_flops()


@pytest.mark.parametrize("method", METHODS)
def test_an_mha_encoder_has_three_ops_per_block_with_their_params_and_flops(method):
    torch.manual_seed(0)
    model, (inputs, target) = family_model("mha_encoder"), family_batch("mha_encoder", 2)
    g = trace_graph(model, inputs, target=target, loss_fn=FAMILIES["mha_encoder"].loss_fn(),
                    method=method)
    ops, names = g.ops, list(g.ops.index)
    x = model.embed(inputs[0])
    b, t, e = x.shape
    for i, attn in enumerate(model.attn):
        fqn = f"attn.{i}"
        in_proj, core, out_proj = f"{fqn}.in_proj", fqn, f"{fqn}.out_proj"
        assert names.index(in_proj) + 1 == names.index(core) == names.index(out_proj) - 1
        assert list(ops.loc[[in_proj, core, out_proj], "kind"]) == ["linear", "attention",
                                                                    "linear"]
        assert ops.loc[in_proj, "params"] == (f"{fqn}.in_proj_weight", f"{fqn}.in_proj_bias")
        assert ops.loc[core, "params"] == ()
        assert ops.loc[out_proj, "params"] == (f"{fqn}.out_proj.weight", f"{fqn}.out_proj.bias")
        assert ops.loc[core, "inputs"] == (in_proj,) and ops.loc[out_proj, "inputs"] == (core,)
        assert ops.loc[in_proj, "plan_refusal"] == ops.loc[out_proj, "plan_refusal"] == ""
        assert "follow their inputs" in ops.loc[core, "plan_refusal"]
        # the projections as linear GEMMs (plus a FLOP per bias element), the core the rest
        # of torch's count for the module
        assert ops.loc[in_proj, "fwd_flops"] == 2 * b * t * e * 3 * e + b * t * 3 * e
        assert ops.loc[out_proj, "fwd_flops"] == 2 * b * t * e * e + b * t * e
        assert ops.loc[core, "fwd_flops"] == 2 * 2 * b * t * t * e  # scores, weighted sum
        total = ops.loc[[in_proj, core, out_proj], "fwd_flops"].sum() - 4 * b * t * e
        assert total == _torch_flops(attn, x, x, x, need_weights=False)
        assert ops.loc[in_proj, "bwd_weight_flops"] == ops.loc[in_proj, "fwd_flops"]
        assert ops.loc[core, "bwd_input_flops"] == 2 * ops.loc[core, "fwd_flops"]
        assert ops.loc[core, "bwd_weight_flops"] == 0
    with_bias = g.params.loc["attn.0.in_proj_bias", "first_op"]
    assert with_bias == "attn.0.in_proj"  # the memory model and buckets find its gradient


class _Attend(nn.Module):
    """An attention module called the ways users call it."""

    def __init__(self, *, batch_first=True, need_weights=False, key_padding=False,
                 mask=False, cross=False, kdim=None, causal=False):
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.memory = nn.Linear(16, kdim or 16)
        self.mha = nn.MultiheadAttention(16, 4, batch_first=batch_first, kdim=kdim, vdim=kdim)
        self.options = dict(need_weights=need_weights, key_padding=key_padding, mask=mask,
                            cross=cross, causal=causal)

    def forward(self, x, memory, key_padding_mask, attn_mask):
        o = self.options
        x = self.pre(x)
        kv = self.memory(memory) if o["cross"] else x
        kwargs = {"need_weights": o["need_weights"], "is_causal": o["causal"]}
        if o["key_padding"]:
            kwargs["key_padding_mask"] = key_padding_mask
        if o["mask"] or o["causal"]:
            kwargs["attn_mask"] = attn_mask
        return self.mha(x, kv, kv, **kwargs)[0].sum()


VARIANTS = {
    "self": {},
    "sequence_first": {"batch_first": False},
    "weights": {"need_weights": True},
    "key_padding": {"key_padding": True},
    "mask": {"mask": True},
    "both_masks": {"key_padding": True, "mask": True},
    "causal": {"mask": True, "causal": True},
    "cross": {"cross": True},
    "cross_weights": {"cross": True, "need_weights": True},
}


def _attend_inputs(batch_first: bool, cross: bool):
    gen = torch.Generator().manual_seed(0)
    tgt, src = 12, (7 if cross else 12)
    shape = (lambda n: (3, n, 16)) if batch_first else (lambda n: (n, 3, 16))
    x, memory = torch.randn(shape(tgt), generator=gen), torch.randn(shape(src), generator=gen)
    key_padding = torch.rand(3, src, generator=gen) > 0.7
    mask = torch.triu(torch.ones(tgt, src, dtype=torch.bool), 1)  # causal when square
    return x, memory, key_padding, mask


class _Total(nn.Module):
    def forward(self, out, target):
        return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_both_tracers_agree_and_count_what_autograd_keeps(variant):
    options = VARIANTS[variant]
    torch.manual_seed(0)
    model = _Attend(**options)
    inputs = _attend_inputs(options.get("batch_first", True), options.get("cross", False))
    target = torch.zeros(())
    graphs = {m: trace_graph(model, inputs, target=target, loss_fn=_Total(), method=m)
              for m in METHODS}
    columns = ["kind", "params", "fwd_flops", "bwd_input_flops", "bwd_weight_flops",
               "saved_bytes"]
    hooks = graphs["hooks"].ops[columns]
    fx = graphs["fx"].ops.loc[hooks.index, columns]  # fx adds views: need_weights' getitems
    assert fx.equals(hooks), (fx, hooks)
    assert {"mha.in_proj", "mha", "mha.out_proj"} <= set(hooks.index)
    measured = autograd_saved_bytes(model, inputs, target, _Total())
    for g in graphs.values():
        assert g.saved_activation_bytes("cpu") == pytest.approx(measured, rel=0.02)


def test_separate_query_key_value_weights_are_the_in_projection_params():
    model = _Attend(cross=True, kdim=8)
    ops = trace_graph(model, _attend_inputs(True, True)).ops
    assert ops.loc["mha.in_proj", "params"] == (
        "mha.q_proj_weight", "mha.k_proj_weight", "mha.v_proj_weight", "mha.in_proj_bias")
    assert ops.loc["mha.in_proj", "inputs"] == ("pre", "memory")
    b, tgt, src, e, kdim = 3, 12, 7, 16, 8
    macs = b * tgt * e * e + 2 * b * src * kdim * e  # each projection with its own weight
    bias = b * (tgt + 2 * src) * e
    assert ops.loc["mha.in_proj", "fwd_flops"] == 2 * macs + bias


def test_an_attention_module_with_key_value_biases_stays_one_op():
    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(16, 4, add_bias_kv=True)

        def forward(self, x):
            return self.mha(x, x, x)[0]

    ops = trace_graph(Biased(), torch.randn(5, 2, 16)).ops
    assert "mha.in_proj" not in ops.index and "mha.out_proj" not in ops.index
    assert ops.loc["mha", "kind"] == "attention" and "mha.bias_k" in ops.loc["mha", "params"]
    assert ops.loc["mha", "plan_refusal"] != ""


def test_a_model_that_is_an_attention_module_names_its_ops_after_its_params():
    mha = nn.MultiheadAttention(16, 4)
    x = torch.randn(5, 2, 16)
    ops = trace_graph(mha, (x, x, x)).ops
    assert list(ops.index[ops["kind"] != "view"]) == ["in_proj", "multiheadattention",
                                                       "out_proj"]  # and need_weights' getitems
    assert ops.loc["in_proj", "params"] == ("in_proj_weight", "in_proj_bias")
    assert ops.loc["out_proj", "params"] == ("out_proj.weight", "out_proj.bias")


def test_a_second_call_names_its_ops_as_a_module_called_twice():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(16, 4, batch_first=True)

        def forward(self, x):
            y = self.mha(x, x, x, need_weights=False)[0]
            return self.mha(y, y, y, need_weights=False)[0]

    x = torch.randn(2, 5, 16)
    names = {m: list(trace_graph(Twice(), x, method=m).ops.index) for m in METHODS}
    assert names["fx"] == names["hooks"] == [
        "mha.in_proj", "mha", "mha.out_proj", "mha.in_proj@1", "mha@1", "mha.out_proj@1"]


def test_the_split_keeps_a_wide_encoder_s_flops_and_memory_beside_torch_s():
    torch.manual_seed(0)
    model = MHAEncoder(dim=128, heads=8)
    inputs, target = family_batch("mha_encoder", 4)
    loss_fn = FAMILIES["mha_encoder"].loss_fn()
    g = trace_graph(model, inputs, target=target, loss_fn=loss_fn)
    attention = g.ops[g.ops.index.str.startswith("attn.")]
    linears = attention[attention["kind"] == "linear"]
    # the projections hold every attention weight and 3/4 of the attention FLOPs (t = 32)
    assert linears["weight_shapes"].map(len).sum() == 4 * 2
    assert linears["fwd_flops"].sum() > 0.75 * attention["fwd_flops"].sum()
    measured = autograd_saved_bytes(model, inputs, target, loss_fn)
    assert g.saved_activation_bytes("cpu") == pytest.approx(measured, rel=0.02)
