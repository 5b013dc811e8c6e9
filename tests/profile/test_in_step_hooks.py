"""In-step op timing of models only the hook tracer can trace: every op timed, named and
ordered as the graph, with one fallback warning per model."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from qsync_lab.costs import read_profile
from qsync_lab.graph import TracingFallbackWarning, trace_graph
from qsync_lab.profile import model_cache, profile_ops
from qsync_lab.profile.in_step import time_ops_in_steps
from tests.graph.sample_models import Box


class Branching(nn.Module):
    """Called as ``model(x=..., scale=...)``; torch.fx cannot trace it: it hands a Python
    object to a module (unless ``branch`` is off)."""

    def __init__(self, branch: bool = True) -> None:
        super().__init__()
        self.branch = branch
        self.fc1 = nn.Linear(8, 8)
        self.carry = nn.Identity()
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x, scale):
        h = torch.relu(self.fc1(x)) * scale
        if self.branch:
            h = self.carry(Box(h)).tensor
        return self.fc2(h @ self.fc1.weight)


def _batch():
    torch.manual_seed(0)
    return {"x": torch.randn(4, 8), "scale": torch.tensor(2.0)}, torch.tensor([0, 1, 2, 0])


def _time(model, precision="fp32", **kwargs):
    batch, target = _batch()
    return time_ops_in_steps(model, batch, target, nn.CrossEntropyLoss(), precision, steps=2,
                             warmup=1, **kwargs)


def _fallbacks(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, TracingFallbackWarning)]


def test_a_model_fx_cannot_trace_has_every_op_timed_in_the_graphs_order_and_names():
    batch, target = _batch()
    model = Branching()
    graph = trace_graph(model, batch, target=target, loss_fn=nn.CrossEntropyLoss(),
                        method="hooks")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = _time(model), _time(model, "bf16")
    assert first.traced_with == second.traced_with == "hooks"
    assert first.ops == second.ops == list(graph.ops.index)
    assert first.ops == ["fc1", "relu", "mul", "matmul", "fc2", "loss"]
    assert (first.forward_us > 0).all() and (first.backward_us > 0).all()
    assert (second.forward_us > 0).all() and (second.backward_us > 0).all()
    fallbacks = _fallbacks(caught)
    assert len(fallbacks) == 1 and "Branching" in fallbacks[0]  # one per model


def test_the_hook_timer_runs_each_op_in_the_precision_the_fx_timer_does():
    fx, hooks = _time(Branching(branch=False), "bf16"), _time(Branching(branch=False), "bf16",
                                                              method="hooks")
    assert (fx.traced_with, hooks.traced_with) == ("fx", "hooks")
    assert hooks.ops == fx.ops
    assert hooks.effective == fx.effective == ["bf16", "fp32", "fp32", "bf16", "bf16", "fp32"]


class TwoAttentions(nn.Module):
    """An ``nn.MultiheadAttention`` called twice (self-attention without weights, then
    cross-attention with them), and one sequence first."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.seq_first = nn.MultiheadAttention(8, 2)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.attn(x, x, x, need_weights=False)[0]
        h, weights = self.attn(h, x, x)
        h = self.seq_first(h.transpose(0, 1), h.transpose(0, 1), h.transpose(0, 1))[0]
        return self.head(h.mean(0) + weights.mean())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_multi_head_attention_is_timed_from_the_hook_trace_as_its_three_ops(precision):
    torch.manual_seed(0)
    x, target = torch.randn(4, 5, 8), torch.tensor([0, 1, 2, 0])
    model, loss_fn = TwoAttentions(), nn.CrossEntropyLoss()
    graph = trace_graph(model, x, target=target, loss_fn=loss_fn, method="hooks")
    fx, hooks = (time_ops_in_steps(model, x, target, loss_fn, precision, steps=2, warmup=1,
                                   method=method) for method in ("fx", "hooks"))
    assert hooks.ops == list(graph.ops.index)
    assert hooks.ops[:6] == ["attn.in_proj", "attn", "attn.out_proj", "attn.in_proj@1",
                             "attn@1", "attn.out_proj@1"]
    fx_effective = dict(zip(fx.ops, fx.effective))  # fx has getitem ops of its own
    assert set(hooks.ops) < set(fx_effective)
    assert hooks.effective == [fx_effective[op] for op in hooks.ops]
    if precision == "bf16":
        assert hooks.effective[:3] == ["bf16", "fp32", "bf16"]  # the core stays fp32
    assert (hooks.forward_us > 0).all()
    weighted = [i for i, op in enumerate(hooks.ops) if op.split("@")[0].endswith("_proj")]
    assert len(weighted) == 6 and (hooks.backward_us[weighted] > 0).all()


def test_gpt2_has_every_op_timed():
    pytest.importorskip("transformers")
    from qsync_lab.models.families import family_batch, family_model
    from qsync_lab.models.library import LogitsLoss

    torch.manual_seed(0)
    model, (batch, target) = family_model("gpt2_decoder"), family_batch("gpt2_decoder", 2)
    logits_loss = LogitsLoss()
    graph = trace_graph(model, batch, target=target, loss_fn=logits_loss, method="hooks")
    t = time_ops_in_steps(model, batch, target, logits_loss, "fp32", steps=2, warmup=1,
                          method="hooks")
    assert t.ops == list(graph.ops.index)
    assert (t.forward_us > 0).all()
    has_gradient = (graph.ops["bwd_input_flops"] + graph.ops["bwd_weight_flops"] > 0).to_numpy()
    untimed = [op for op, g, us in zip(t.ops, has_gradient, t.backward_us) if g and us == 0]
    assert has_gradient.sum() > 30
    assert untimed == ["transformer.to"]  # to() its own dtype: its input, no autograd node


def test_profile_rows_of_a_model_fx_cannot_trace_name_the_graphs_ops():
    batch, target = _batch()
    model = Branching()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = profile_ops(model, batch, target, nn.CrossEntropyLoss(), ["fp32", "bf16"],
                           repeats=2, warmup=1, progress=False)
        graph = trace_graph(model, batch, target=target, loss_fn=nn.CrossEntropyLoss())
    assert set(rows["op"]) == set(graph.ops.index)
    assert (rows["time_us"] > 0).all()
    assert len(_fallbacks(caught)) == 1  # one per model: the profile's (the trace says no more)


def test_the_cached_model_profile_of_a_hook_only_model_is_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("QSYNC_LAB_CACHE", str(tmp_path))
    for name, value in (("REPEATS", 2), ("STEP_REPEATS", 2), ("WARMUP", 1)):
        monkeypatch.setattr(model_cache, name, value)
    batch, target = _batch()
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0,
                            world_size=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            path = model_cache.ranks_profile_model(
                Branching(), {4: (batch, target)}, nn.CrossEntropyLoss(),
                fingerprint="branching", batch_sizes=[4], precisions=["fp32", "bf16"])
    finally:
        dist.destroy_process_group()
    fallbacks = _fallbacks(caught)
    assert len(fallbacks) == 1 and "timed with module hooks" in fallbacks[0]
    assert set(read_profile(path).frame["op"]) == {"fc1", "relu", "mul", "matmul", "fc2", "loss"}
