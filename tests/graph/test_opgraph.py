import gc
import sys
import warnings

import pytest
import torch
import torch.nn as nn

from qsync_lab.errors import QSyncError
from qsync_lab.graph import TracingFallbackWarning, trace_graph

from tests.graph.sample_models import DataDependent, Opaque, Residual, TinyEncoder, cnn, mlp


def op(graph, name):
    return graph.ops.loc[name]


def test_conv2d_flops_match_hand_count():
    # out 2x8x5x5 (stride 2, pad 1 on 10x10), groups=2: each output reads 6/2*3*3 inputs
    model = nn.Sequential(nn.ReLU(), nn.Conv2d(6, 8, 3, stride=2, padding=1, groups=2))
    g = trace_graph(model, torch.randn(2, 6, 10, 10))
    conv = op(g, "1")
    out = 2 * 8 * 5 * 5
    macs = out * (6 // 2) * 3 * 3
    assert conv["kind"] == "conv2d"
    assert conv["output_shapes"] == ((2, 8, 5, 5),)
    assert conv["fwd_flops"] == 2 * macs + out
    assert conv["bwd_input_flops"] == 2 * macs
    assert conv["bwd_weight_flops"] == 2 * macs + out
    assert conv["weight_shapes"] == ((8, 3, 3, 3), (8,))
    assert conv["weight_dtypes"] == ("float32", "float32")
    assert conv["input_dtypes"] == ("float32",) and conv["params"] == ("1.weight", "1.bias")


def test_linear_on_3d_input_and_first_layer_needs_no_input_grad():
    g = trace_graph(nn.Linear(16, 24, bias=False), torch.randn(3, 5, 16))
    lin = op(g, "linear") if "linear" in g.ops.index else g.ops.iloc[0]
    macs = 3 * 5 * 24 * 16
    assert lin["fwd_flops"] == 2 * macs
    assert lin["bwd_weight_flops"] == 2 * macs
    assert lin["bwd_input_flops"] == 0  # its input is data: autograd computes no grad for it


def test_batched_matmul_flops_and_both_operand_grads():
    g = trace_graph(TinyEncoder(), torch.randint(0, 50, (2, 6)))
    mm = op(g, "a.matmul")
    assert mm["kind"] == "matmul"
    assert mm["input_shapes"] == ((2, 2, 6, 8), (2, 2, 8, 6))
    macs = 2 * 2 * 6 * 6 * 8
    assert (mm["fwd_flops"], mm["bwd_input_flops"], mm["bwd_weight_flops"]) == (
        2 * macs, 4 * macs, 0)
    assert set(mm["inputs"]) == {"a.transpose", "a.transpose_3"}


def test_kinds_cover_the_attention_block():
    g = trace_graph(TinyEncoder(), torch.randint(0, 50, (2, 6)), target=torch.tensor([1, 3]),
                    loss_fn=nn.CrossEntropyLoss())
    kinds = g.ops["kind"]
    assert kinds["emb"] == "embedding"
    assert kinds["a.softmax"] == "softmax"
    assert kinds["a.drop"] == "dropout"
    assert kinds["a.norm"] == "layer_norm"
    assert kinds["a.add"] == "add"
    assert kinds["a.div"] == "mul"
    assert kinds["a.view"] == "view"
    assert kinds["loss"] == "loss"
    assert g.ops.index[-1] == "loss"
    assert not g.ops.index.duplicated().any()


def test_fx_and_hook_tracers_agree_on_every_column():
    model, ids = TinyEncoder(), torch.randint(0, 50, (2, 6))
    fx_graph = trace_graph(model, ids, method="fx")
    hook_graph = trace_graph(model, ids, method="hooks")
    assert (fx_graph.traced_with, hook_graph.traced_with) == ("fx", "hooks")
    cols = [c for c in fx_graph.ops.columns if c != "target"]
    pd_equal = fx_graph.ops[cols].equals(hook_graph.ops[cols])
    assert pd_equal, fx_graph.ops[cols].compare(hook_graph.ops[cols])
    assert fx_graph.fingerprint() == hook_graph.fingerprint()


def test_depth_is_longest_path_and_views_add_none():
    g = trace_graph(Residual(), torch.randn(2, 8))
    depth = g.ops["depth"]
    assert depth["fc1"] == 0 and depth["relu"] == 1 and depth["fc2"] == 2
    assert depth["add"] == 3  # max over fc2 (2) and the input (skip connection)
    assert depth["flatten"] == 4
    assert depth["fc3"] == 4  # flatten is a view: no extra depth
    assert set(g.edges.itertuples(index=False, name=None)) >= {("fc2", "add"), ("add", "flatten")}


def autograd_saved_bytes(model, inputs, target, loss_fn):
    """Bytes of the storages autograd saves (parameters excluded), each counted once."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model(*inputs), target)
    return sum(seen.values())


@pytest.mark.parametrize("build,make_input", [
    (mlp, lambda: torch.randn(32, 64)),
    (cnn, lambda: torch.randn(32, 1, 8, 8)),
    (TinyEncoder, lambda: torch.randint(0, 50, (4, 12))),
])
def test_saved_activation_bytes_match_autograd(build, make_input):
    torch.manual_seed(0)
    model, x = build(), make_input()
    target = torch.randint(0, 5, (x.shape[0],))
    loss_fn = nn.CrossEntropyLoss()
    g = trace_graph(model, x, target=target, loss_fn=loss_fn)
    actual = autograd_saved_bytes(model, (x,), target, loss_fn)
    assert g.saved_activation_bytes("cpu") == pytest.approx(actual, rel=1e-3)
    assert g.saved_activation_bytes("cuda") <= g.saved_activation_bytes("cpu")


def test_tracing_leaves_the_model_unchanged():
    model = cnn().train()
    model[1].eval()  # a mixed train/eval state must survive too
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trace_graph(model, torch.randn(4, 1, 8, 8))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.training and not model[1].training and model[4].training


def test_a_model_branching_on_values_is_traced_by_fx_on_its_example():
    model = DataDependent()
    nn.init.constant_(model.fc.weight, 0.5)  # positive sum: the branch is taken
    graph = trace_graph(model, torch.ones(2, 4))
    assert graph.traced_with == "fx"
    assert list(graph.ops.index) == list(trace_graph(model, torch.ones(2, 4),
                                                     method="hooks").ops.index)
    assert list(graph.ops.index) == ["fc", "sum", "gt", "mul", "act"]
    nn.init.constant_(model.fc.weight, -0.5)  # the other path
    assert list(trace_graph(model, torch.ones(2, 4)).ops.index) == ["fc", "sum", "gt", "act"]


def test_untraceable_model_falls_back_to_hooks_with_a_warning():
    model = Opaque()
    with pytest.warns(TracingFallbackWarning, match="torch.fx cannot trace Opaque"):
        g = trace_graph(model, torch.ones(2, 4))
    assert g.traced_with == "hooks"
    assert list(g.ops.index) == ["fc", "mul", "act"]
    assert g.ops.loc["act", "inputs"] == ("mul",)
    assert g.ops.loc["mul", "inputs"] == ("fc",) and g.ops.loc["act", "depth"] == 2


def test_the_hook_fallback_warns_once_per_model_naming_the_model():
    model, x, target = Opaque(), torch.ones(2, 4), torch.tensor([0, 1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # with its loss: the wrapper is no name the user knows
            trace_graph(model, x, target=target, loss_fn=nn.CrossEntropyLoss())
        trace_graph(Opaque(), x)  # another model: its own warning
    messages = [str(w.message) for w in caught if w.category is TracingFallbackWarning]
    assert len(messages) == 2
    assert all(m.startswith("torch.fx cannot trace Opaque (") for m in messages)


def test_fx_only_tracing_of_untraceable_model_is_a_one_line_error():
    model = Opaque()
    with pytest.raises(QSyncError, match="use method='hooks'") as err:
        trace_graph(model, torch.ones(2, 4), method="fx")
    assert "\n" not in str(err.value)
    assert "rows" not in vars(model)  # the failed traces left no proxy on the model


@pytest.mark.parametrize("call,message", [
    (lambda: trace_graph([nn.Linear(2, 2)], torch.ones(1, 2)), "expected a torch.nn.Module"),
    (lambda: trace_graph(nn.Linear(2, 2), [1.0, 2.0]), "example_inputs must be a tensor"),
    (lambda: trace_graph(nn.Linear(2, 2), torch.ones(1, 2), method="jit"), "unknown tracing"),
    (lambda: trace_graph(nn.Linear(2, 2), torch.ones(1, 2), target=torch.ones(1)),
     "give both target and loss_fn"),
])
def test_bad_input_is_a_one_line_error(call, message):
    with pytest.raises(QSyncError, match=message) as err:
        call()
    assert "\n" not in str(err.value)


def test_totals_and_kind_summary_add_up():
    model = mlp()
    g = trace_graph(model, torch.randn(4, 64))
    totals = g.totals()
    assert totals["param_count"] == sum(p.numel() for p in model.parameters())
    assert totals["fwd_flops"] == g.ops["fwd_flops"].sum()
    summary = g.kind_summary()
    assert summary.loc["linear", "ops"] == 3
    assert summary["fwd_gflops"].sum() == pytest.approx(totals["fwd_flops"] / 1e9)


def test_fingerprint_tells_models_apart():
    x = torch.randn(2, 64)
    assert trace_graph(mlp(), x).fingerprint() == trace_graph(mlp(), x).fingerprint()
    other = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    assert trace_graph(other, x).fingerprint() != trace_graph(mlp(), x).fingerprint()
    # another batch size is the same model (each rank of an uneven plan traces its own)
    assert trace_graph(mlp(), torch.randn(5, 64)).fingerprint() == trace_graph(mlp(), x).fingerprint()


def test_activation_costs_follow_the_function_not_a_substring():
    # "relu" contains "elu": ReLU must still cost 1 FLOP per element, GELU/ELU 8
    model = nn.Sequential(nn.ReLU(), nn.GELU(), nn.ELU(), nn.Tanh())
    g = trace_graph(model, torch.randn(4, 8))
    assert g.ops["fwd_flops"].tolist() == [32, 8 * 32, 8 * 32, 8 * 32]
    assert g.ops["saved_bytes"].tolist() == [128] * 4  # each keeps a 4x8 fp32 tensor


def test_single_module_model_with_loss_is_named_after_its_class():
    g = trace_graph(nn.Linear(4, 2), torch.randn(3, 4), target=torch.tensor([0, 1, 1]),
                    loss_fn=nn.CrossEntropyLoss())
    assert list(g.ops.index) == ["linear", "loss"]


def test_traces_from_several_threads_do_not_mix():
    # torch.fx patches nn.Module.__call__ process-wide while it traces: two runs started
    # side by side from a notebook's threads traced each other's modules
    from concurrent.futures import ThreadPoolExecutor

    from qsync_lab.models import example_batch, get_model, model_spec

    def trace(name):
        inputs, target = example_batch(name, 2)
        return trace_graph(get_model(name), inputs, target=target,
                           loss_fn=model_spec(name).loss_fn())

    names = ["digits_cnn", "digits_mlp"] * 6
    want = {name: len(trace(name).ops) for name in set(names)}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns often, as under load
    try:
        with ThreadPoolExecutor(4) as pool:
            graphs = list(pool.map(trace, names))
    finally:
        sys.setswitchinterval(interval)
    assert [len(g.ops) for g in graphs] == [want[name] for name in names]


def test_a_trace_on_the_example_holds_no_activation_after_it():
    """A rank traces its model inside the run's memory window: the example's activations
    must be freed when the trace ends, not at some later garbage collection."""
    from qsync_lab.runtime.memory import MemoryWindow

    model, x = DataDependent(), torch.ones(4096, 4)  # each activation 64 KiB
    nn.init.constant_(model.fc.weight, 0.5)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        window = MemoryWindow(cuda=False)
        assert trace_graph(model, x).traced_with == "fx"
        after = torch.zeros(1024, 1024)  # 4 MiB, allocated after the trace
        peak_bytes = window.close()
    finally:
        if gc_was_enabled:
            gc.enable()
    assert peak_bytes == after.nbytes
