"""One name per op: the plannable ops of the traced graph are the ops the indicator scores
and the ops ``apply_plan_`` sets, for the zoo, the user-model families and (with the
``models`` extra) library models."""

import copy
import warnings

import pytest
import torch

from qsync_lab.graph import TracingFallbackWarning, trace_graph
from qsync_lab.indicator.statistics import collect_statistics
from qsync_lab.models import example_batch, get_model, model_spec
from qsync_lab.models.families import FAMILIES, family, family_batch, family_model
from qsync_lab.models.library import LIBRARY
from qsync_lab.policy import PLANNABLE_KINDS
from qsync_lab.quant import apply_plan_, describe_precisions

#: the zoo but its large models (the same layers as their small siblings)
ZOO = ["bert_mini", "digits_cnn", "digits_mlp", "resnet18"]
#: families traced with module hooks too (as models torch.fx cannot trace are)
HOOK_TRACED = ["gpt_decoder", "mha_encoder", "vit", "depthwise_cnn"]


def _case(source: str, name: str):
    torch.manual_seed(0)
    if source == "zoo":
        return get_model(name), example_batch(name, 2), model_spec(name).loss_fn()
    if source == "library":
        pytest.importorskip("transformers")
    return family_model(name), family_batch(name, 2), family(name).loss_fn()


@pytest.mark.parametrize("source, name, method", [("zoo", n, "auto") for n in ZOO]
                         + [("family", n, "auto") for n in sorted(FAMILIES)]
                         + [("family", n, "hooks") for n in HOOK_TRACED]
                         + [("library", n, m) for n in sorted(LIBRARY) for m in ("auto", "hooks")])
def test_tracer_indicator_and_apply_name_every_op_alike(source, name, method):
    model, (inputs, target), loss_fn = _case(source, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TracingFallbackWarning)
        graph = trace_graph(model, inputs, target=target, loss_fn=loss_fn, method=method)
    ops = graph.ops
    names = set(ops.index[ops["kind"].isin(PLANNABLE_KINDS) & (ops["plan_refusal"] == "")])
    assert names
    stats = collect_statistics(model, [(inputs, target)], loss_fn, precisions=["fp16"],
                               num_batches=1, progress=False)
    assert set(stats["op"]) == names
    planned = copy.deepcopy(model)
    apply_plan_(planned, dict.fromkeys(names, "fp16"))
    described = describe_precisions(planned)  # modules the forward never calls stay fp32
    assert set(described.index[described["forward"] == "fp16"]) == names
