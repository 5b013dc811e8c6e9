import numpy as np
import pytest
import torch
import torch.nn as nn

from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph
from qsync_lab.indicator import collect_statistics, indicator, noise_energy
from qsync_lab.models import example_batch, get_model, model_spec

LOSS = nn.CrossEntropyLoss()


def two_layer(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5, bias=False), nn.ReLU(), nn.Linear(5, 3, bias=False))
    x = torch.randn(4, 6)
    y = torch.tensor([0, 2, 1, 2])
    return model, x, y


# ---- independent references ------------------------------------------------------------

def ref_int8_noise(v, c=1 / 12):
    v = v.detach().numpy().astype(np.float64)
    step = np.abs(v).max() / 127
    return c * step**2 * np.count_nonzero(v)


def ref_float_noise(v, man_bits, exp_bits):
    v = v.detach().numpy().astype(np.float64)
    v = v[v != 0]
    binade = np.floor(np.log2(np.abs(v)))
    emin = 2 - 2 ** (exp_bits - 1)
    return float(np.sum((2.0 ** (np.maximum(binade, emin) - man_bits)) ** 2) / 12)


def test_two_layer_terms_equal_a_hand_computation():
    model, x, y = two_layer()
    graph = trace_graph(model, x, target=y, loss_fn=LOSS)
    scores = indicator(model, graph, [(x, y)], loss_fn=LOSS, precisions=["int8", "fp16"],
                       num_batches=1, progress=False)
    # activations and output gradients by plain autograd
    out0 = model[0](x)
    out0.retain_grad()
    h = model[1](out0)
    out2 = model[2](h)
    out2.retain_grad()
    LOSS(out2, y).backward()
    layers = {"0": (x, model[0].weight, out0.grad, False), "2": (h, model[2].weight, out2.grad, True)}
    depth = {"0": 0, "2": 2}
    total_depth = 3  # the loss op is deepest
    for name, (a, w, g, needs_input_grad) in layers.items():
        n_a, n_b, n_g = a.numel(), w.numel(), g.numel()
        macs = g.numel() * w.shape[1]
        s_a, s_b, s_g = (float(t.detach().double().square().sum()) for t in (a, w, g))
        e_a, e_b = ref_int8_noise(a), ref_int8_noise(w)
        e_g = ref_float_noise(g, 10, 5)  # int8 ops run backward in fp16
        v_f = macs / (n_a * n_b) * (e_a * s_b + e_b * s_a)
        v_b = macs / (n_a * n_g) * (e_a * s_g + e_g * s_a)
        if needs_input_grad:
            v_b += macs / (n_g * n_b) * (e_g * s_b + e_b * s_g)
        omega = 4 * (total_depth - depth[name]) * v_f + depth[name] * v_b
        fisher = v_f * s_g / n_g
        row = scores.loc[name]
        assert row[("int8", "fisher")] == pytest.approx(fisher, rel=1e-5)
        assert row[("int8", "V_f")] == pytest.approx(v_f, rel=1e-5)
        assert row[("int8", "V_b")] == pytest.approx(v_b, rel=1e-5)
        assert row[("int8", "omega")] == pytest.approx(omega, rel=1e-5)
    assert list(scores.index) == ["0", "2"]


@pytest.mark.parametrize("precision,torch_round", [
    ("fp16", lambda v: v.half().float()),
    ("bf16", lambda v: v.bfloat16().float()),
    ("fp8_e4m3", lambda v: _scaled(v, torch.float8_e4m3fn, 448.0)),
    ("fp8_e5m2", lambda v: _scaled(v, torch.float8_e5m2, 57344.0)),
    ("int8", lambda v: torch.round(v / (v.abs().max() / 127)) * (v.abs().max() / 127)),
])
def test_noise_energy_predicts_the_error_of_the_real_cast(precision, torch_round):
    torch.manual_seed(1)
    v = torch.randn(100_000) * 2.5
    v[::4] = 0  # exact zeros (as after a ReLU) carry no error
    actual = float((torch_round(v) - v).double().square().sum())
    assert noise_energy(v, precision) == pytest.approx(actual, rel=0.03)


def _scaled(v, dtype, fmt_max):
    scale = v.abs().max() / fmt_max
    return (v / scale).to(dtype).float() * scale


def test_noise_energy_matches_an_independent_ulp_sum_including_subnormals():
    v = torch.tensor([1e-6, 3e-5, 0.5, -7.0, 0.0, 6e-8])
    assert noise_energy(v, "fp16") == pytest.approx(ref_float_noise(v, 10, 5), rel=1e-12)
    assert noise_energy(v, "bf16") == pytest.approx(ref_float_noise(v, 7, 8), rel=1e-12)
    assert noise_energy(torch.zeros(7), "fp8_e4m3") == 0.0
    assert noise_energy(v, "int8", "stochastic") == pytest.approx(2 * noise_energy(v, "int8"))


@pytest.fixture(scope="module")
def cnn_scores():
    name = "resnet18"
    model = get_model(name, num_classes=10)
    batches = [example_batch(name, 2, seed=s, num_classes=10, image_size=32) for s in range(2)]
    graph = trace_graph(model, batches[0][0], target=batches[0][1],
                        loss_fn=model_spec(name).loss_fn())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    scores = indicator(model, graph, batches, loss_fn=model_spec(name).loss_fn(),
                       num_batches=2, progress=False)
    return model, graph, batches, scores, before, rng


def test_profiling_leaves_weights_buffers_grads_and_rng_unchanged(cnn_scores):
    model, _, _, _, before, rng = cnn_scores
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_fp32_scores_zero_and_formats_order_by_mantissa_width(cnn_scores):
    scores = cnn_scores[3]
    omega = scores.xs("omega", axis=1, level=1)
    assert (omega["fp32"] == 0).all()
    assert (omega["fp16"] <= omega["bf16"]).all()
    norms = scores[("op", "kind")] == "batch_norm"  # the policy allows them fp32, fp16, bf16
    assert norms.sum() == 20 and omega[~norms].notna().all().all()
    assert omega.loc[norms, ["int8", "fp8_e4m3", "fp8_e5m2", "tf32"]].isna().all().all()
    assert (omega.loc[norms, "fp16"] > 0).all()
    omega = omega[~norms]
    assert (omega["fp8_e4m3"] <= omega["fp8_e5m2"]).all()
    assert (omega["bf16"] <= omega["fp8_e4m3"]).all()
    weighted = scores[("op", "kind")].isin(["conv2d", "linear"])
    assert weighted.sum() == 21  # ResNet-18: 20 convs + fc
    assert (omega.loc[weighted, "int8"] > 0).all()


def test_depth_weights_the_terms(cnn_scores):
    _, graph, _, scores, _, _ = cnn_scores
    depth = scores[("op", "depth")]
    total = graph.ops["depth"].max()
    expected = 4 * (total - depth) * scores[("int8", "V_f")] + depth * scores[("int8", "V_b")]
    assert np.allclose(scores[("int8", "omega")], expected, equal_nan=True)
    expected = 4 * (total - depth) * scores[("fp16", "V_f")] + depth * scores[("fp16", "V_b")]
    assert np.allclose(scores[("fp16", "omega")], expected)  # norms included
    assert depth.iloc[0] == 0 and depth.iloc[-1] > 20  # conv1 first, fc deep


def test_deterministic_for_a_seed_and_dropout_follows_the_seed():
    name = "bert_mini"
    kw = dict(num_layers=1, hidden=32, heads=2, intermediate=64, vocab_size=50, max_positions=16)
    model = get_model(name, **kw)
    batches = [example_batch(name, 2, seed=s, seq_len=8, **kw) for s in range(2)]
    graph = trace_graph(model, batches[0][0])
    run = lambda seed: indicator(model, graph, batches, loss_fn=LOSS, precisions=["fp16"],  # noqa: E731
                                 num_batches=2, seed=seed, progress=False)
    first, again, other = run(0), run(0), run(1)
    assert first.equals(again)
    assert not first.equals(other)  # dropout masks differ
    matmuls = first[first[("op", "kind")] == "matmul"]
    assert len(matmuls) == 2
    assert (matmuls[("fp16", "V_f")] > 0).all() and (matmuls[("fp16", "V_b")] > 0).all()


def test_statistics_average_over_the_batches():
    model, x, y = two_layer()
    batches = [(x, y), (2 * x, y)]
    stats = collect_statistics(model, batches, LOSS, precisions=["int8"], num_batches=2,
                               progress=False)
    assert stats["batch"].tolist() == [0, 0, 1, 1]
    first = stats[stats["op"] == "0"]
    assert first["sumsq_a"].iloc[1] == pytest.approx(4 * first["sumsq_a"].iloc[0], rel=1e-6)


@pytest.mark.parametrize("call,message", [
    (lambda m, g, b: indicator(m, g, b, loss_fn=LOSS, num_batches=0, progress=False),
     "num_batches must be at least 1"),
    (lambda m, g, b: indicator(m, g, b, loss_fn=LOSS, num_batches=3, progress=False),
     "only 1 calibration batches"),
    (lambda m, g, b: indicator(m, g, b, loss_fn=LOSS, num_batches=1, rounding="up",
                               progress=False), "unknown rounding"),
    (lambda m, g, b: indicator(m, g, b, loss_fn=LOSS, num_batches=1, gamma=-1,
                               progress=False), "gamma must be"),
    (lambda m, g, b: indicator(nn.Sequential(nn.ReLU()),
                               trace_graph(nn.Sequential(nn.ReLU()), torch.ones(1, 6)), b,
                               loss_fn=nn.MSELoss(), num_batches=1, progress=False),
     "has no op a plan can set"),
    (lambda m, g, b: indicator(m, trace_graph(nn.Linear(6, 3), torch.ones(1, 6)), b,
                               loss_fn=LOSS, num_batches=1, progress=False),
     "not in the graph"),
])
def test_bad_input_is_a_one_line_error(call, message):
    model, x, y = two_layer()
    graph = trace_graph(model, x)
    with pytest.raises(QSyncError, match=message) as err:
        call(model, graph, [(x, y)])
    assert "\n" not in str(err.value)


def test_risk_is_the_fisher_term_unless_asked_for_qsyncs_omega(cnn_scores):
    model, graph, batches, scores, _, _ = cnn_scores
    assert np.allclose(scores[("int8", "risk")], scores[("int8", "fisher")], equal_nan=True)
    omega_risk = indicator(model, graph, batches[:1], loss_fn=model_spec("resnet18").loss_fn(),
                           precisions=["int8"], num_batches=1, risk="omega", progress=False)
    assert np.allclose(omega_risk[("int8", "risk")], omega_risk[("int8", "omega")],
                       equal_nan=True)
    with pytest.raises(QSyncError, match="unknown risk 'hawq'; choose one of: fisher, omega"):
        indicator(model, graph, batches, loss_fn=model_spec("resnet18").loss_fn(),
                  risk="hawq", progress=False)


def test_hawq_scores_models_built_on_scaled_dot_product_attention():
    from qsync_lab.indicator.baselines import hawq_scores
    from qsync_lab.models.families import family_batch, family_model, FAMILIES

    torch.manual_seed(0)
    model = family_model("gpt_decoder")
    batch = family_batch("gpt_decoder", 2)
    scores = hawq_scores(model, [batch], FAMILIES["gpt_decoder"].loss_fn(), ["int8"],
                         num_batches=1, samples=1)
    # the embedding, 2 blocks x (qkv, proj, fc, out) and the head that shares its weight
    assert len(scores) == 10 and np.isfinite(scores["int8"]).all()
