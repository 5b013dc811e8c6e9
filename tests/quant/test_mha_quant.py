"""``nn.MultiheadAttention`` with planned projections (qsync_lab.quant.attention): torch's
forward and gradients when fp32, each projection's rounding when not, plans from the
allocator."""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qsync_lab.errors import QSyncError
from qsync_lab.graph.attention import split_forward
from qsync_lab.policy import OpPrecision
from qsync_lab.precision import Precision
from qsync_lab.quant import (apply_plan_, describe_precisions, low_precision_call,
                             restore_rounding_counters, rounding_counters)
from qsync_lab.quant.attention import split_attention_class
from qsync_lab.quant.resolve import function_runs_in

E, HEADS = 32, 4


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-6) -> bool:
    """Equal to within ``tol`` of ``b``'s largest magnitude (float rounding of a reordered
    sum: the split applies out_proj to rows in the module's layout, torch to (L·N) rows)."""
    return bool((a - b).abs().max() <= tol * max(1.0, float(b.detach().abs().max())))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


#: how far the same low-precision math may land from a torch reference: the fp32 GEMMs of
#: rounded operands may sum in another order (MKL picks kernels by alignment), which flips
#: the rounding of an output now and then by one ulp
SAME_MATH = 2e-5


CALLS = {
    "self": dict(),
    "sequence_first": dict(batch_first=False),
    "weights": dict(need_weights=True),
    "weights_per_head": dict(need_weights=True, average_attn_weights=False),
    "key_padding": dict(key_padding=True),
    "bool_mask": dict(mask="bool"),
    "float_mask": dict(mask="float", need_weights=True),
    "both_masks": dict(key_padding=True, mask="bool"),
    "causal": dict(mask="bool", is_causal=True),
    "cross": dict(cross=True),
    "cross_kdim": dict(cross=True, kdim=24, need_weights=True),
    "unbatched": dict(unbatched=True, key_padding=True),
    "dropout": dict(dropout=0.3),
    "dropout_weights": dict(dropout=0.3, need_weights=True),
}


def _case(batch_first=True, need_weights=False, average_attn_weights=True, key_padding=False,
          mask=None, is_causal=False, cross=False, kdim=None, unbatched=False, dropout=0.0):
    """(attention module, its inputs, its keyword arguments) of one way users call it."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, dropout=dropout, batch_first=batch_first, kdim=kdim,
                                vdim=kdim)
    tgt, src, n = 10, (6 if cross else 10), 3
    shape = (lambda s, e: (s, e)) if unbatched else (
        (lambda s, e: (n, s, e)) if batch_first else (lambda s, e: (s, n, e)))
    x = torch.randn(shape(tgt, E))
    kv = torch.randn(shape(src, kdim or E)) if cross else x
    kwargs = {"need_weights": need_weights, "average_attn_weights": average_attn_weights,
              "is_causal": is_causal}
    if key_padding:
        padding = torch.zeros((src,) if unbatched else (n, src), dtype=torch.bool)
        padding[..., -2:] = True
        kwargs["key_padding_mask"] = padding
    if mask is not None:
        causal = torch.triu(torch.ones(tgt, src, dtype=torch.bool), 1)
        kwargs["attn_mask"] = causal if mask == "bool" else torch.randn(tgt, src)
    return mha, (x, kv, kv), kwargs


def _run(mha, inputs, kwargs, seed=1):
    """Output, attention weights and gradients (inputs, then parameters) of one call."""
    leaves = [t.detach().clone().requires_grad_() for t in dict.fromkeys(inputs)]
    by_id = {id(t): leaf for t, leaf in zip(dict.fromkeys(inputs), leaves)}
    torch.manual_seed(seed)
    out, weights = mha(*(by_id[id(t)] for t in inputs), **kwargs)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return out, weights, [t.grad for t in leaves] + [p.grad for p in mha.parameters()]


@pytest.mark.parametrize("call", sorted(CALLS))
def test_the_split_forward_equals_torch_forward_and_gradients(call):
    mha, inputs, kwargs = _case(**CALLS[call])
    split = copy.deepcopy(mha)
    split.__class__ = split_attention_class(nn.MultiheadAttention)  # both projections fp32
    out, weights, grads = _run(split, inputs, kwargs)
    ref_out, ref_weights, ref_grads = _run(mha, inputs, kwargs)
    assert out.shape == ref_out.shape and _close(out, ref_out)
    assert (weights is None) == (ref_weights is None)
    assert weights is None or _close(weights, ref_weights)
    for g, ref in zip(grads, ref_grads, strict=True):
        assert _close(g, ref), (g - ref).abs().max()


def test_an_fp32_plan_gives_back_torch_s_module_bit_for_bit():
    mha, inputs, kwargs = _case(key_padding=True)
    ref_out, _, ref_grads = _run(copy.deepcopy(mha), inputs, kwargs)
    apply_plan_(mha, {"in_proj": "int8", "out_proj": "fp16"})
    apply_plan_(mha, {"in_proj": "fp32", "out_proj": "fp32"})
    assert type(mha) is nn.MultiheadAttention and type(mha.out_proj).__name__ == \
        "NonDynamicallyQuantizableLinear"
    assert "in_proj_precision" not in vars(mha)
    out, _, grads = _run(mha, inputs, kwargs)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(g, ref) for g, ref in zip(grads, ref_grads))


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).float()


def _fp16_linear(x, weight, bias):
    """torch's linear on fp16 operands, fp32 accumulation, fp16 output (a tensor core)."""
    return _rounded(F.linear(_rounded(x, torch.half), _rounded(weight, torch.half),
                             None if bias is None else _rounded(bias, torch.half)), torch.half)


def _int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-tensor int8 codes (round half to even) and their scale."""
    scale = t.detach().abs().amax() / 127
    return torch.round(t.detach() / scale).clamp(-127, 127), scale


def _int8_linear(x, weight, bias):
    """int8 x int8 products summed exactly (float64), rescaled, bias added in fp32."""
    (qx, sx), (qw, sw) = _int8(x), _int8(weight)
    out = F.linear(qx.double(), qw.double()).float() * (sx * sw)
    return out if bias is None else out + bias


class _Projection(nn.Module):
    def __init__(self, linear: nn.Linear, gemm) -> None:
        super().__init__()
        self.linear, self.gemm = linear, gemm

    def forward(self, x):
        return self.gemm(x, self.linear.weight, self.linear.bias)


def _reference(mha: nn.Module, inputs, kwargs, gemm) -> torch.Tensor:
    """The split forward with both projections computed by ``gemm`` (torch ops)."""
    ref = copy.deepcopy(mha)
    ref.out_proj = _Projection(ref.out_proj, gemm)
    with torch.no_grad():
        return split_forward(ref, *inputs, **kwargs, linear=gemm)[0]


def _step_noise(t: torch.Tensor) -> float:
    """RMS rounding error of per-tensor int8, relative to ``t``'s RMS: a uniform error
    over one step (amax/127) has variance step²/12."""
    t = t.detach()
    step = float(t.abs().amax()) / 127
    return step / math.sqrt(12) / float(t.pow(2).mean().sqrt())


@pytest.mark.parametrize("call", ["self", "sequence_first", "cross", "weights"])
def test_fp16_projections_round_as_torch_does_and_stay_within_fp16_error(call):
    mha, inputs, kwargs = _case(**CALLS[call])
    with torch.no_grad():
        fp32 = mha(*inputs, **kwargs)[0]
    apply_plan_(mha, {"in_proj": "fp16", "out_proj": "fp16"})
    out = mha(*inputs, **kwargs)[0]
    assert _relative(out, _reference(mha, inputs, kwargs, _fp16_linear)) < SAME_MATH
    # each rounding is within u = 2**-11 relative (RMS u/sqrt(3)); two operands and the
    # output of each GEMM, in two GEMMs in a row: well within 4u, never 0
    u = 2.0 ** -11
    assert u / 8 < _relative(out, fp32) < 4 * u


@pytest.mark.parametrize("call", ["self", "sequence_first", "cross", "cross_kdim"])
def test_int8_projections_quantize_as_torch_does_and_stay_within_int8_error(call):
    mha, inputs, kwargs = _case(**CALLS[call])
    with torch.no_grad():
        fp32 = mha(*inputs, **kwargs)[0]
    apply_plan_(mha, {"in_proj": "int8", "out_proj": "int8"})
    out = mha(*inputs, **kwargs)[0]
    assert _relative(out, _reference(mha, inputs, kwargs, _int8_linear)) < SAME_MATH
    # the rounding noise of the operands along the way: the inputs and in-projection
    # weights, then the core's output and out_proj's weight
    with torch.no_grad():
        attended = []
        mha.out_proj.register_forward_hook(lambda m, args, y: attended.append(args[0]))
        mha(*inputs, **kwargs)
    weights = [mha.in_proj_weight] if mha._qkv_same_embed_dim else [mha.q_proj_weight]
    operands = [inputs[0], *weights, attended[0], mha.out_proj.weight]
    expected = math.sqrt(sum(_step_noise(t) ** 2 for t in operands))
    assert expected / 2 < _relative(out, fp32) < 2 * expected, (_relative(out, fp32), expected)


def test_low_precision_projections_train_into_fp32_weights():
    mha, inputs, kwargs = _case(key_padding=True)
    _, _, ref_grads = _run(copy.deepcopy(mha), inputs, kwargs)
    apply_plan_(mha, {"in_proj": "int8", "out_proj": "bf16"})
    _, _, grads = _run(mha, inputs, kwargs)
    for g, ref in zip(grads, ref_grads):
        assert g.dtype == torch.float32 and torch.isfinite(g).all()
        assert _relative(g, ref) < 0.05  # int8 forward, fp16 / bf16 backward


def test_a_plan_keeps_parameters_and_state_dict_keys():
    mha, inputs, kwargs = _case(cross=True, kdim=24)
    params = dict(mha.named_parameters())
    keys = list(mha.state_dict())
    apply_plan_(mha, {"in_proj": "fp8_e4m3", "out_proj": "int8"})
    assert list(mha.state_dict()) == keys
    assert all(p is params[n] for n, p in mha.named_parameters())
    fresh = copy.deepcopy(mha)
    fresh.load_state_dict(copy.deepcopy(nn.MultiheadAttention(E, HEADS, batch_first=True,
                                                              kdim=24, vdim=24).state_dict()))
    assert not torch.equal(fresh(*inputs, **kwargs)[0], mha(*inputs, **kwargs)[0])


def test_describe_and_rounding_counters_name_the_projections_as_the_graph_does():
    model = nn.Sequential(nn.Linear(E, E))
    model.add_module("attn", nn.MultiheadAttention(E, HEADS, batch_first=True))
    apply_plan_(model, {"attn.in_proj": {"forward": "int8", "rounding": "stochastic"},
                        "attn.out_proj": "fp16"})
    described = describe_precisions(model)
    assert list(described.index) == ["0", "attn.in_proj", "attn.out_proj"]
    assert described.loc["attn.in_proj", ["kind", "forward", "rounding"]].tolist() == [
        "linear", "int8", "stochastic"]
    x = torch.randn(2, 5, E)
    first = model.attn(x, x, x)[0]
    counters = rounding_counters(model)
    assert counters == {"attn.in_proj": 1, "attn.out_proj": 1}
    second = model.attn(x, x, x)[0]
    assert not torch.equal(first, second)  # the stochastic stream moved on
    restore_rounding_counters(model, counters)
    assert torch.equal(model.attn(x, x, x)[0], second)


def test_the_projections_of_an_attention_with_key_value_biases_are_refused():
    model = nn.Sequential()
    model.add_module("attn", nn.MultiheadAttention(E, HEADS, add_bias_kv=True))
    for fqn in ("attn.in_proj", "attn.out_proj"):
        with pytest.raises(QSyncError, match="runs as one attention op in fp32") as err:
            apply_plan_(model, {fqn: "fp16"})
        assert "\n" not in str(err.value)
    assert type(model.attn) is nn.MultiheadAttention
    assert list(describe_precisions(model).index) == []


def test_the_profiler_s_functional_in_projection_computes_the_module_s():
    mha, inputs, kwargs = _case()
    assert function_runs_in("mha_in_projection", "int8")
    x = inputs[0]
    args = ((x,), (0, 0, 0), (mha.in_proj_weight,), mha.in_proj_bias, True)
    projections = low_precision_call("mha_in_projection", args, {},
                                     OpPrecision.parse("fp16"), (0, 1))
    packed = _fp16_linear(x.transpose(1, 0), mha.in_proj_weight, mha.in_proj_bias)
    for p, ref in zip(projections, packed.chunk(3, -1), strict=True):
        assert (p - ref).abs().le(2.0 ** -10 * ref.abs()).all()  # within one fp16 ulp


def test_the_allocator_plans_the_projections_and_the_plan_runs():
    from qsync_lab.allocate import allocate_detailed
    from qsync_lab.cluster import load_cluster
    from qsync_lab.costs import CostModel
    from qsync_lab.devices import load_catalog
    from qsync_lab.graph import trace_graph
    from qsync_lab.indicator import indicator
    from qsync_lab.models.families import FAMILIES, MHAEncoder, family_batch
    from qsync_lab.quant import apply_resolved_plan_
    from qsync_lab.simulate import prepare_graph

    torch.manual_seed(0)
    model = MHAEncoder(dim=512, heads=8)  # wide enough that a T4 must quantize to keep up
    (ids,), target = family_batch("mha_encoder", 16)
    loss_fn = FAMILIES["mha_encoder"].loss_fn()
    graph = trace_graph(model, ids, target=target, loss_fn=loss_fn)
    scores = indicator(model, graph, [((ids,), target)], loss_fn=loss_fn,
                       precisions=["fp16", "int8"], num_batches=1, progress=False)
    assert {"attn.0.in_proj", "attn.0.out_proj"} <= set(scores.index)
    cluster = load_cluster("v100-t4-small")
    plan = allocate_detailed(prepare_graph(graph), cluster, CostModel(), scores).plan
    plan.validate(graph, cluster)
    low = {op for op, cfg in plan.precisions["T4"].items() if not cfg.is_fp32}
    assert {"attn.0.in_proj", "attn.0.out_proj", "attn.1.in_proj", "attn.1.out_proj"} & low
    runs = copy.deepcopy(model)
    applied = apply_resolved_plan_(runs, graph, plan.precisions["T4"],
                                   load_catalog().device("T4"))
    assert {op for op in applied if ".in_proj" in op or ".out_proj" in op} == {
        op for op in low if ".in_proj" in op or ".out_proj" in op}
    loss = loss_fn(runs(ids), target)
    loss.backward()
    assert abs(loss.item() - loss_fn(model(ids), target).item()) < 0.01
    assert all(torch.isfinite(p.grad).all() for p in runs.parameters())
    assert Precision.FP32 not in {plan.precisions["T4"][op].forward for op in low}


def test_the_indicator_scores_each_projection_as_the_linear_it_runs():
    from qsync_lab.graph import trace_graph
    from qsync_lab.indicator import collect_statistics, indicator

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(E, HEADS, batch_first=True)
            self.head = nn.Linear(E, 3)

        def forward(self, x):
            return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))

    torch.manual_seed(0)
    model, x, y = Block(), torch.randn(4, 6, E), torch.tensor([0, 1, 2, 0])
    loss_fn = nn.CrossEntropyLoss()
    stats = collect_statistics(model, [(x, y)], loss_fn, precisions=["int8"], num_batches=1,
                               progress=False).set_index("op")
    # self-attention's in-projection is one GEMM: x (N·L, E) by in_proj_weight (3E, E)
    packed = []
    probe = copy.deepcopy(model)

    def linear(a, w, b):
        out = F.linear(a, w, b)
        out.retain_grad()
        packed.append(out)
        return out

    probe.attn.forward = lambda *args, **kw: split_forward(probe.attn, *args, **kw,
                                                           linear=linear)
    loss_fn(probe(x), y).backward()
    row = stats.loc["attn.in_proj"]
    assert row["kind"] == "linear" and row["macs"] == 4 * 6 * 3 * E * E
    assert row["numel_a"] == x.numel() and row["numel_b"] == 3 * E * E
    assert row["sumsq_a"] == pytest.approx(float(x.pow(2).sum()), rel=1e-5)
    assert row["sumsq_b"] == pytest.approx(float(model.attn.in_proj_weight.detach().pow(2).sum()),
                                           rel=1e-5)
    assert row["sumsq_g"] == pytest.approx(float(packed[0].grad.pow(2).sum()), rel=1e-5)
    assert stats.loc["attn.out_proj", "macs"] == 4 * 6 * E * E
    graph = trace_graph(model, x, target=y, loss_fn=loss_fn)
    scores = indicator(model, graph, [(x, y)], loss_fn=loss_fn, precisions=["int8"],
                       num_batches=1, progress=False)
    assert list(scores.index) == ["attn.in_proj", "attn.out_proj", "head"]  # not the core
    assert (scores[("int8", "risk")] > 0).all()
    assert type(model.attn) is nn.MultiheadAttention and "forward" not in vars(model.attn)
