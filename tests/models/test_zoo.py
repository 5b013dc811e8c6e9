"""Tests for the model zoo: parameter counts, shapes, gradients, fx tracing and errors."""

import dataclasses
import functools
from collections import Counter

import pytest
import torch
from torch import fx, nn

from qsync_lab.errors import QSyncError
from qsync_lab.models import (
    MatMul,
    ModelSpec,
    example_batch,
    get_model,
    list_models,
    model_spec,
)
from qsync_lab.graph import symbolic_trace as trace_model

TINY_BERT = dict(num_layers=2, hidden=32, heads=4, intermediate=64, vocab_size=100, max_positions=64)

#: Per-model keyword arguments that keep every forward pass fast on a CPU.
SMALL = {
    "resnet18": dict(num_classes=10, image_size=32),
    "resnet50": dict(num_classes=10, image_size=32),
    "vgg16_bn": dict(num_classes=10, image_size=32),
    "bert_base": dict(TINY_BERT, num_labels=3, seq_len=16),
    "bert_mini": dict(TINY_BERT, num_labels=3, seq_len=16),
    "digits_cnn": dict(num_classes=10),
    "digits_mlp": dict(in_features=40, num_classes=10),
}
#: The big models run a single sample; BatchNorm in eval mode makes that fine.
BATCH_SIZE = {"resnet50": 1, "vgg16_bn": 1}
EXPECTED_OUTPUT_WIDTH = {"bert_base": 3, "bert_mini": 3}


@functools.cache
def small_eval_model(name: str) -> nn.Module:
    """A small-config model in eval mode, built once per test session (tests must not mutate it)."""
    torch.manual_seed(0)
    return get_model(name, **SMALL[name]).eval()


def build_on_meta(name: str, **kwargs) -> nn.Module:
    """Build a (possibly huge) model without allocating or initialising real weights."""
    with torch.device("meta"):
        return get_model(name, **kwargs)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def bert_parameter_formula(
    num_layers: int, hidden: int, intermediate: int, vocab_size: int, max_positions: int, type_vocab_size: int
) -> int:
    """Parameters of embeddings + encoder + pooler, counted by hand from the architecture."""
    layer_norm = 2 * hidden
    embeddings = (vocab_size + max_positions + type_vocab_size) * hidden + layer_norm
    attention = 4 * (hidden * hidden + hidden) + layer_norm  # query, key, value, output dense
    feed_forward = (hidden * intermediate + intermediate) + (intermediate * hidden + hidden) + layer_norm
    pooler = hidden * hidden + hidden
    return embeddings + num_layers * (attention + feed_forward) + pooler


def assert_one_line_error(excinfo: pytest.ExceptionInfo, *words: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message
    for word in words:
        assert word in message, f"{word!r} missing from {message!r}"


# --- registry -------------------------------------------------------------------------------


def test_list_models_is_sorted_and_complete():
    assert list_models() == [
        "bert_base",
        "bert_mini",
        "digits_cnn",
        "digits_mlp",
        "resnet18",
        "resnet50",
        "vgg16_bn",
    ]


@pytest.mark.parametrize("name", list_models())
def test_model_spec_is_frozen_and_its_loss_accepts_the_model_output(name):
    spec = model_spec(name)
    assert isinstance(spec, ModelSpec) and spec.name == name and spec.description and spec.task
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]
    inputs, target = example_batch(name, BATCH_SIZE.get(name, 2), **SMALL[name])
    loss = spec.loss_fn()(small_eval_model(name)(*inputs), target)
    assert isinstance(spec.loss_fn(), nn.Module)
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_model_spec_defaults_list_model_and_batch_arguments():
    assert model_spec("resnet18").defaults == {"num_classes": 1000, "image_size": 224}
    mini = model_spec("bert_mini").defaults
    assert (mini["num_layers"], mini["hidden"], mini["heads"], mini["intermediate"]) == (4, 256, 4, 1024)
    assert mini["seq_len"] == 128 and mini["max_positions"] == 512


def test_model_names_are_case_insensitive():
    assert model_spec(" ResNet18 ") is model_spec("resnet18")


# --- parameter counts -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [("resnet18", 11_689_512), ("resnet50", 25_557_032), ("vgg16_bn", 138_365_992)],
)
def test_vision_models_match_published_parameter_counts(name, expected):
    assert count_parameters(build_on_meta(name)) == expected


def test_bert_base_matches_published_and_hand_counted_parameters():
    model = build_on_meta("bert_base")
    body = count_parameters(model.bert)
    assert body == 109_482_240
    assert body == bert_parameter_formula(12, 768, 3072, 30522, 512, 2)
    assert count_parameters(model) - body == 768 * 2 + 2


def test_bert_custom_config_matches_hand_count():
    dims = dict(num_layers=3, hidden=48, intermediate=80, vocab_size=101, max_positions=40, type_vocab_size=3)
    model = build_on_meta("bert_mini", heads=6, num_labels=5, **dims)
    assert count_parameters(model.bert) == bert_parameter_formula(**dims)
    assert count_parameters(model) - count_parameters(model.bert) == 48 * 5 + 5


def test_bert_mini_uses_mini_dimensions():
    model = build_on_meta("bert_mini")
    assert len(model.bert.encoder.layer) == 4
    assert count_parameters(model.bert) == bert_parameter_formula(4, 256, 1024, 30522, 512, 2)


def test_small_models_have_the_described_layers():
    assert count_parameters(get_model("digits_mlp")) == (40 * 128 + 128) + (128 * 128 + 128) + (128 * 10 + 10)
    cnn_convs = (1 * 16 * 9 + 16) + (16 * 32 * 9 + 32)
    cnn_bns = 2 * 16 + 2 * 32
    cnn_fcs = (512 * 64 + 64) + (64 * 10 + 10)
    assert count_parameters(get_model("digits_cnn")) == cnn_convs + cnn_bns + cnn_fcs


# --- forward, backward, initialisation ------------------------------------------------------


@pytest.mark.parametrize("name", list_models())
def test_forward_output_shape(name):
    batch_size = BATCH_SIZE.get(name, 2)
    inputs, target = example_batch(name, batch_size, **SMALL[name])
    with torch.no_grad():
        output = small_eval_model(name)(*inputs)
    width = EXPECTED_OUTPUT_WIDTH.get(name, SMALL[name].get("num_classes"))
    assert output.shape == (batch_size, width)
    assert output.dtype == torch.float32 and torch.isfinite(output).all()
    assert target.shape == (batch_size,) and target.dtype == torch.int64


@pytest.mark.parametrize("name", ["resnet18", "bert_mini", "digits_cnn", "digits_mlp"])
def test_backward_reaches_every_parameter(name):
    torch.manual_seed(0)
    model = get_model(name, **SMALL[name]).train()
    inputs, target = example_batch(name, 4, **SMALL[name])
    model_spec(name).loss_fn()(model(*inputs), target).backward()
    for param_name, param in model.named_parameters():
        assert param.grad is not None, f"{param_name} got no gradient"
        assert torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, param_name


@pytest.mark.parametrize("name", list_models())
def test_initialisation_is_deterministic_under_manual_seed(name):
    kwargs = SMALL[name]
    torch.manual_seed(123)
    first = get_model(name, **kwargs).state_dict()
    torch.manual_seed(123)
    second = get_model(name, **kwargs).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "vgg16_bn", "digits_cnn"])
def test_conv_models_initialise_batchnorm_to_identity(name):
    norms = [m for m in small_eval_model(name).modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and all(torch.all(m.weight == 1) and torch.all(m.bias == 0) for m in norms)


def test_vgg_classifier_initialisation():
    linears = [m for m in small_eval_model("vgg16_bn").classifier if isinstance(m, nn.Linear)]
    assert len(linears) == 3 and all(torch.all(m.bias == 0) for m in linears)
    assert abs(linears[0].weight.std().item() - 0.01) < 0.001


def test_bert_initialisation():
    torch.manual_seed(0)
    model = get_model("bert_mini", num_layers=1, hidden=128, heads=2, intermediate=256, vocab_size=2000)
    query = model.bert.encoder.layer[0].attention.self.query
    assert abs(query.weight.std().item() - 0.02) < 0.002 and torch.all(query.bias == 0)
    assert abs(model.bert.embeddings.word_embeddings.weight.std().item() - 0.02) < 0.002
    norm = model.bert.embeddings.LayerNorm
    assert torch.all(norm.weight == 1) and torch.all(norm.bias == 0)


def test_matmul_module_is_parameter_free_matmul():
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    assert torch.equal(MatMul()(a, b), torch.matmul(a, b))
    assert not list(MatMul().parameters())
    assert MatMul.op_kind == "matmul"  # how qsync_lab.graph recognises it as one operator


# --- fx tracing -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list_models())
def test_symbolic_trace_matches_eager(name):
    model = small_eval_model(name)
    inputs, _ = example_batch(name, BATCH_SIZE.get(name, 2), seed=1, **SMALL[name])
    with torch.no_grad():
        expected = model(*inputs)
        torch.testing.assert_close(fx.symbolic_trace(model)(*inputs), expected)
        torch.testing.assert_close(trace_model(model)(*inputs), expected)


def call_module_targets(graph_module: fx.GraphModule) -> list[str]:
    return [node.target for node in graph_module.graph.nodes if node.op == "call_module"]


@pytest.mark.parametrize("name", list_models())
def test_every_module_call_site_is_a_distinct_module(name):
    model = build_on_meta(name)  # full size: tracing needs no real weights
    repeated = [t for t, n in Counter(call_module_targets(fx.symbolic_trace(model))).items() if n > 1]
    assert not repeated
    targets = call_module_targets(trace_model(model))
    assert len(targets) == len(set(targets))
    leaves = {fqn for fqn, module in model.named_modules() if not list(module.children())}
    assert set(targets) == leaves  # every leaf module is called, and exactly once


def test_bert_attention_matmuls_have_their_own_fqns():
    targets = call_module_targets(trace_model(build_on_meta("bert_base")))
    matmuls = [t for t in targets if t.endswith("_matmul")]
    assert len(matmuls) == 2 * 12
    assert "bert.encoder.layer.0.attention.self.score_matmul" in matmuls
    assert "bert.encoder.layer.11.attention.self.context_matmul" in matmuls


def test_bert_position_ids_follow_the_sequence_length():
    model = small_eval_model("bert_mini")
    traced = fx.symbolic_trace(model)
    for seq_len in (5, 64):
        (input_ids,), _ = example_batch("bert_mini", 2, seq_len=seq_len, **TINY_BERT)
        with torch.no_grad():
            torch.testing.assert_close(traced(input_ids), model(input_ids))


# --- example batches ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list_models())
def test_example_batch_is_deterministic_per_seed_and_leaves_global_rng_alone(name):
    rng_state = torch.get_rng_state()
    first = example_batch(name, 2, seed=7, **SMALL[name])
    second = example_batch(name, 2, seed=7, **SMALL[name])
    other = example_batch(name, 2, seed=8, **SMALL[name])
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert torch.equal(first[0][0], second[0][0]) and torch.equal(first[1], second[1])
    assert not torch.equal(first[0][0], other[0][0])


def test_image_batch_shape_and_label_range():
    (images,), target = example_batch("resnet50", 64, num_classes=3, image_size=40)
    assert images.shape == (64, 3, 40, 40) and images.dtype == torch.float32
    assert target.dtype == torch.int64 and 0 <= target.min() and target.max() < 3
    (images,), _ = example_batch("resnet18")
    assert images.shape == (2, 3, 224, 224)


def test_token_batch_respects_vocab_and_labels():
    (input_ids,), target = example_batch("bert_base", 8, seq_len=32, vocab_size=50, num_labels=4)
    assert input_ids.shape == (8, 32) and input_ids.dtype == torch.int64
    assert 0 <= input_ids.min() and input_ids.max() < 50 and target.max() < 4


def test_digits_batches():
    (images,), target = example_batch("digits_cnn", 3)
    assert images.shape == (3, 1, 8, 8) and target.shape == (3,)
    (features,), _ = example_batch("digits_mlp", 3, in_features=40)
    assert features.shape == (3, 40)


def test_one_kwargs_dict_serves_model_and_batch():
    kwargs = dict(num_classes=7, image_size=32)
    model = get_model("resnet18", **kwargs).eval()
    inputs, _ = example_batch("resnet18", 1, **kwargs)
    with torch.no_grad():
        assert model(*inputs).shape == (1, 7)


# --- bad input ------------------------------------------------------------------------------


def test_unknown_model_lists_the_choices():
    with pytest.raises(QSyncError) as excinfo:
        get_model("resnet5")
    assert_one_line_error(excinfo, "unknown model 'resnet5'", "choose one of", *list_models())
    with pytest.raises(QSyncError):
        example_batch("resnet5")


@pytest.mark.parametrize("call", [get_model, example_batch])
def test_unknown_kwarg_lists_the_accepted_ones(call):
    with pytest.raises(QSyncError) as excinfo:
        call("resnet18", num_clases=10)
    assert_one_line_error(excinfo, "'num_clases'", "resnet18", "num_classes", "image_size")


def test_hidden_must_be_divisible_by_heads():
    with pytest.raises(QSyncError) as excinfo:
        get_model("bert_mini", hidden=100, heads=12)
    assert_one_line_error(excinfo, "hidden (100)", "divisible", "heads (12)")


def test_seq_len_above_max_positions():
    with pytest.raises(QSyncError) as excinfo:
        example_batch("bert_base", seq_len=513)
    assert_one_line_error(excinfo, "seq_len 513", "max_positions 512")


@pytest.mark.parametrize(
    ("name", "kwargs", "words"),
    [
        ("resnet18", dict(num_classes=0), ("num_classes", "positive integer")),
        ("vgg16_bn", dict(num_classes=2.5), ("num_classes", "positive integer")),
        ("bert_mini", dict(num_layers=-1), ("num_layers", "positive integer")),
        ("bert_mini", dict(dropout=1.5), ("dropout", "[0, 1)")),
        ("digits_mlp", dict(in_features=True), ("in_features", "positive integer")),
    ],
)
def test_invalid_model_sizes(name, kwargs, words):
    with pytest.raises(QSyncError) as excinfo:
        get_model(name, **kwargs)
    assert_one_line_error(excinfo, *words)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(batch_size=0), ("batch_size", "positive integer")),
        (dict(image_size=16), ("image_size", "at least 32")),
        (dict(seed="zero"), ("seed", "integer")),
        (dict(num_classes=-3), ("num_classes", "positive integer")),
    ],
)
def test_invalid_batch_arguments(kwargs, words):
    with pytest.raises(QSyncError) as excinfo:
        example_batch("resnet18", **kwargs)
    assert_one_line_error(excinfo, *words)
