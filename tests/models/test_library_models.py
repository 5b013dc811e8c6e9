"""Library models (``transformers``, the ``models`` extra) through every stage: traced by
torch.fx on their example batch (as the hook tracer sees them), every weight-bearing layer
plannable (names agree: ``tests/test_op_names.py``), the graph's GEMM FLOPs against
torch's counter, a plan that applies and trains a step, and the simulator; a bf16 plan's
GEMMs run natively in bf16 and every op is profiled in-step, on the CPU and (``--gpu``) on
CUDA."""

import copy
import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from qsync_lab import Study
from qsync_lab.costs import op_work
from qsync_lab.graph import TracingFallbackWarning, trace_graph
from qsync_lab.models.families import family_batch, family_model
from qsync_lab.models.library import LIBRARY, LogitsLoss
from qsync_lab.policy import GEMM_KINDS, PLANNABLE_KINDS
from qsync_lab.profile.ops import profile_ops
from qsync_lab.quant import apply_plan_
from qsync_lab.quant.native import execution
from tests.gemm_calls import GemmCalls

pytest.importorskip("transformers")

logits_loss = LogitsLoss()

#: "native": CPU tensors forced through the native path (torch's kernels, as a GPU runs
#: them); "cpu": the CPU as it runs; "cuda": a GPU
NATIVE = ["native", pytest.param("cuda", marks=pytest.mark.gpu)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

#: parameters no plannable op holds, by model: (name pattern, why)
NOT_PLANNED = {
    "vit_classifier": ("cls_token", "position_embeddings"),  # added to activations
    "swin_classifier": ("relative_position_bias_table",),  # gathered into a bias
}


@pytest.fixture(scope="module", params=sorted(LIBRARY))
def traced(request):
    torch.manual_seed(0)
    model, (batch, target) = family_model(request.param), family_batch(request.param, 2)
    graph = trace_graph(model, batch, target=target, loss_fn=logits_loss)  # no fallback
    return request.param, model, batch, target, graph


def test_torch_fx_traces_it_on_its_example_as_the_hooks_see_it(traced):
    _, model, batch, target, graph = traced
    hooks = trace_graph(model, batch, target=target, loss_fn=logits_loss, method="hooks")
    assert (graph.traced_with, hooks.traced_with) == ("fx", "hooks")
    assert _plannable(graph) == _plannable(hooks)

    def flops(g):
        return g.ops[["fwd_flops", "bwd_input_flops", "bwd_weight_flops"]].to_numpy().sum()
    assert flops(graph) == pytest.approx(flops(hooks), rel=1e-4)


def _plannable(graph) -> list[str]:
    ops = graph.ops
    return ops.index[ops["kind"].isin(PLANNABLE_KINDS) & (ops["plan_refusal"] == "")].tolist()


def test_at_least_95_percent_of_the_parameters_are_plannable(traced):
    name, model, _, _, graph = traced
    owners = {id(p): n for n, p in model.named_parameters()}
    by_name = dict(model.named_parameters(remove_duplicate=False))
    planned = {id(by_name[p]) for op in _plannable(graph) for p in graph.ops.at[op, "params"]}
    total = sum(p.numel() for p in model.parameters())
    left = {owners[i]: p.numel() for i, p in ((id(p), p) for p in model.parameters())
            if i not in planned}
    assert sum(left.values()) <= 0.05 * total, left
    reasons = NOT_PLANNED.get(name, ())
    assert all(any(r in n for r in reasons) for n in left), left


#: the gathers (indexing by a tensor: copies, not views) of the library models: Swin's
#: relative-position bias tables, BERT's padding mask (indexed by batch and position)
_GATHERS = {"swin_classifier": "relative_position_bias.getitem", "bert_encoder": "bert.getitem"}


def test_the_batch_size_is_found_and_gathers_are_copies(traced):
    name, _, _, _, graph = traced
    assert op_work(graph).traced_batch_size == 2  # not a buffer's leading 1
    gathers = graph.ops.index[graph.ops["target"].str.contains("getitem")
                              & (graph.ops["kind"] == "copy")]
    reads = _GATHERS.get(name)
    assert all(reads is not None and reads in op for op in gathers), list(gathers)
    assert len(gathers) > 0 or reads is None


def test_the_graphs_gemm_flops_are_torchs(traced):
    _, model, batch, target, graph = traced
    ops = graph.ops
    gemm = ops[ops["kind"].isin(GEMM_KINDS | {"attention"})]
    ours = int((gemm["fwd_flops"] + gemm["bwd_input_flops"] + gemm["bwd_weight_flops"]).sum())
    counted = copy.deepcopy(model)
    with FlopCounterMode(display=False) as counter:
        logits_loss(counted(**batch), target).backward()
    assert 0.95 <= ours / counter.get_total_flops() <= 1.08
    plannable = ops.loc[[op for op in _plannable(graph) if ops.at[op, "kind"] in GEMM_KINDS]]
    planned = (plannable["fwd_flops"] + plannable["bwd_input_flops"]
               + plannable["bwd_weight_flops"]).sum()
    assert planned >= 0.93 * counter.get_total_flops()  # the rest: the attention cores


def test_a_low_precision_plan_trains_a_step_close_to_fp32(traced):
    _, model, batch, target, graph = traced
    torch.manual_seed(1)  # the same dropout masks in both
    reference = logits_loss(model(**batch), target)
    planned = copy.deepcopy(model)
    apply_plan_(planned, dict.fromkeys(_plannable(graph), "bf16"))
    torch.manual_seed(1)
    loss = logits_loss(planned(**batch), target)
    loss.backward()
    assert abs(loss.item() - reference.item()) <= 0.05 * abs(reference.item())
    grads = [p.grad for p in planned.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_the_allocators_plan_simulates_and_applies(traced):
    name, model, batch, target, _ = traced
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TracingFallbackWarning)
        study = Study(model, example_batch=(batch, target), cluster="local-hybrid",
                      loss_fn=logits_loss, progress=False)
        fp32_peak_gib = study.simulate().tensor_peak_bytes.iloc[1] / 2**30
        plan = study.plan(memory_limit={"T4": 0.97 * fp32_peak_gib})
    assert plan.low_precision_ops()["T4"] > 0, name
    assert study.simulate(plan).iteration_us > 0
    planned = copy.deepcopy(model)
    apply_plan_(planned, plan.precisions["T4"])
    logits_loss(planned(**batch), target).backward()


@pytest.mark.parametrize("device", NATIVE)
def test_a_bf16_plans_gemms_multiply_bf16_operands(traced, device):
    """Natively, every plannable linear and convolution runs its forward product in bf16
    (cuBLAS / cuDNN on a GPU), and the step's loss and gradients are finite."""
    _, model, batch, target, graph = traced
    where = "cpu" if device == "native" else device
    planned = copy.deepcopy(model).to(where)
    batch, target = {k: v.to(where) for k, v in batch.items()}, target.to(where)
    apply_plan_(planned, dict.fromkeys(_plannable(graph), "bf16"))
    gemms = [op for op in _plannable(graph) if graph.ops.at[op, "kind"] in GEMM_KINDS]
    with execution("native" if device == "native" else "auto"):
        with GemmCalls() as forward:
            loss = logits_loss(planned(**batch), target)
        loss.backward()
    in_bf16 = [name for name, dtypes, _ in forward.calls
               if dtypes == (torch.bfloat16, torch.bfloat16)]
    assert len(in_bf16) >= len(gemms) > 0, (len(in_bf16), len(gemms))
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in planned.parameters() if p.grad is not None)


@pytest.mark.parametrize("device", DEVICES)
def test_every_plannable_op_is_profiled_in_step_in_each_precision(traced, device):
    _, model, batch, target, graph = traced
    rows = profile_ops(model, batch, target, logits_loss, ["fp32", "bf16"], device=device,
                       repeats=3, warmup=1, progress=False)
    forward = rows[rows["phase"] == "forward"]
    for precision in ("fp32", "bf16"):
        timed = set(forward.loc[forward["precision"] == precision, "op"])
        assert set(_plannable(graph)) <= timed, set(_plannable(graph)) - timed
    assert (forward["time_us"] > 0).all()
