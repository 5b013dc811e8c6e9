"""Peak memory against a hand count on a 2-layer model."""

import pandas as pd
import pytest
import torch
import torch.nn as nn
from tests.simulate.conftest import FAST, SLOW

from qsync_lab.cluster import load_cluster
from qsync_lab.costs import CostModel, op_work
from qsync_lab.devices import load_catalog
from qsync_lab.graph import trace_graph
from qsync_lab.models.families import GPTDecoder, SequenceCrossEntropy
from qsync_lab.policy import resolve_precisions
from qsync_lab.simulate import memory_breakdown, simulate
from qsync_lab.simulate.memory import MemoryModel


def _two_layers():
    # Linear(8, 16) -> ReLU -> Linear(16, 4), traced at batch 2
    return trace_graph(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                       torch.randn(2, 8))


def _peak_moment(moments: dict[str, dict[str, int]]) -> dict[str, int]:
    """The backward moment (op -> held activations, gradients, workspace) with most bytes."""
    return max(moments.values(), key=lambda held: sum(held.values()))


def test_memory_equals_hand_count_on_two_layers(make_cluster):
    sim = simulate(_two_layers(), {SLOW: {"0": "fp16"}}, make_cluster([FAST, SLOW], [4, 4]),
                   CostModel(), optimizer="adam")
    params = (16 * 8 + 16) + (4 * 16 + 4)  # 212 elements
    fp32, fp16 = 4, 2
    grad0, grad1 = (16 * 8 + 16) * fp32, (4 * 16 + 4) * fp32
    # T4 at batch 4: layer 0 saves an fp16 copy of its input (4x8); the ReLU follows layer
    # 0 in fp16 and saves its fp16 output (4x16); layer 1, fp32, an fp32 copy of it (fp32
    # GEMMs take fp32 inputs); backward runs layer 1, ReLU, layer 0, each holding its
    # output grad + input grad at its backward precision
    saved = {"0": 4 * 8 * fp16, "1": 4 * 16 * fp16, "2": 4 * 16 * fp32}
    moments = {
        "2": {"activations": saved["0"] + saved["1"] + saved["2"], "gradients": grad1,
              "workspace": (4 * 4 + 4 * 16) * fp32},
        "1": {"activations": saved["0"] + saved["1"], "gradients": grad1,
              "workspace": (4 * 16 + 4 * 16) * fp16},
        "0": {"activations": saved["0"], "gradients": grad0 + grad1,
              "workspace": (4 * 16 + 4 * 8) * fp16},
    }
    expected_t4 = {
        "master_weights": params * fp32,
        "low_precision_weights": (16 * 8 + 16) * fp16,          # layer 0's fp16 copy
        "ddp_buckets": params * fp32,
        "optimizer_state": 2 * params * fp32,                    # Adam: two moments
        **_peak_moment(moments),                                 # layer 0's backward
    }
    assert _peak_moment(moments) == moments["0"]
    assert sim.memory_breakdown.loc[1].to_dict() == pytest.approx(expected_t4)
    assert sim.tensor_peak_bytes[1] == pytest.approx(sum(expected_t4.values()))
    v100 = sim.memory_breakdown.loc[0]
    assert v100["low_precision_weights"] == 0
    assert v100["activations"] == 4 * 8 * fp32                  # peak at layer 0 again
    assert v100["gradients"] == grad0 + grad1


def test_activation_heavy_batch_peaks_at_the_start_of_backward(make_cluster):
    batch = 4096  # activations dwarf the 848 gradient bytes
    sim = simulate(_two_layers(), {}, make_cluster([FAST], [batch]), CostModel(),
                   optimizer="sgd")
    held = sim.memory_breakdown.loc[0]
    # everything saved: the input, the ReLU's output (which layer 1 saves too, one tensor,
    # freed after the ReLU's backward: its backward, with the larger gradients, is the peak)
    assert held["activations"] == batch * (8 + 16) * 4
    assert held["gradients"] == (4 * 16 + 4) * 4                # only layer 1's grads yet
    assert held["workspace"] == batch * (16 + 16) * 4


@pytest.mark.parametrize("optimizer, states", [("sgd", 0), ("sgd_momentum", 1), ("adamw", 2)])
def test_optimizer_state(graph, make_cluster, optimizer, states):
    sim = simulate(graph, {}, make_cluster([FAST]), CostModel(), optimizer=optimizer)
    assert sim.memory_breakdown.loc[0, "optimizer_state"] == states * graph.params["bytes"].sum()


# -- saved activations against what autograd keeps -----------------------------------------

def _autograd_saved_bytes(model, inputs, target, loss_fn) -> int:
    """Bytes of the storages autograd keeps for backward over one forward and loss, each
    counted once (parameters and buffers, which the model holds anyway, left out)."""
    held = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model(*inputs), target)
    return sum(seen.values())


def _held_activations(model, inputs, target, loss_fn, batch_size, plan=None) -> float:
    """Everything the memory model holds for backward (what it holds at the start of
    backward), traced at batch 2 and predicted at ``batch_size``."""
    graph = trace_graph(model, tuple(t[:2] for t in inputs), target=target[:2], loss_fn=loss_fn)
    work = op_work(graph)
    assignment = resolve_precisions(work, plan or {}, load_catalog().device("T4"))
    model = MemoryModel(work, graph.params, optimizer="sgd", bucket_bytes=0.0)
    return float(model.saved(assignment, batch_size=batch_size).sum())


class _ConvBlock(nn.Module):
    """conv -> BN -> ReLU (in place) -> conv -> ReLU -> max-pool -> linear, as torchvision's
    ResNets are built: the in-place ReLU's output is the BN's, and the next conv saves it
    too."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        x = self.relu2(self.conv2(self.relu1(self.bn(self.conv1(x)))))
        return self.fc(torch.flatten(self.pool(x), 1))


def test_a_tensor_several_ops_save_is_held_once():
    """The ReLU's output and the next conv's input are one tensor (so are the second ReLU's
    output and the pool's input): held once, as autograd keeps them. The old count held
    both twice: 1.5x what autograd keeps, here and on ResNet-50."""
    torch.manual_seed(0)
    model, batch = _ConvBlock(), 16
    x, target = torch.randn(batch, 3, 8, 8), torch.randint(0, 5, (batch,))
    kept = _autograd_saved_bytes(model, (x,), target, nn.CrossEntropyLoss())
    held = _held_activations(model, (x,), target, nn.CrossEntropyLoss(), batch)
    # within the batch norm's per-channel statistics, which the model scales with the batch
    assert held == pytest.approx(kept, rel=5e-3)


def test_a_gpt_decoders_loss_scales_with_the_batch_and_attention_output_is_shared():
    """A GPT decoder: causal SDPA (its output, viewed, is the out-projection's input) and a
    loss over ``(batch * tokens, vocab)`` logits, whose first dimension is not the batch:
    the loss's log-probabilities grow with the batch all the same."""
    torch.manual_seed(0)
    model, batch = GPTDecoder(vocab=64, dim=32, heads=4, layers=2, max_len=16), 8
    ids = torch.randint(0, 64, (batch, 17))
    inputs, target = (ids[:, :-1],), ids[:, 1:]
    kept = _autograd_saved_bytes(model, inputs, target, SequenceCrossEntropy())
    held = _held_activations(model, inputs, target, SequenceCrossEntropy(), batch)
    assert held == pytest.approx(kept, rel=1e-3)


def _fork():
    # fc0 -> fc1 and fc2 both read (and save) fc0's output
    class Fork(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc0, self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)

        def forward(self, x):
            h = self.fc0(x)
            return self.fc1(h) + self.fc2(h)
    torch.manual_seed(0)
    return Fork()


@pytest.mark.parametrize("plan, held_h", [
    ({}, 1.0),                                       # one fp32 tensor, both keep it
    ({"fc1": "fp16"}, 1.5),                          # fc1 its fp16 copy, fc2 the tensor
    ({"fc2": "fp16"}, 1.5),
    ({"fc1": "fp16", "fc2": "fp16"}, 1.0),           # two fp16 copies, the tensor freed
])
def test_a_shared_tensor_is_held_once_as_is_plus_each_encoded_copy(plan, held_h):
    batch = 4096  # activations dwarf the weights
    x = torch.randn(batch, 8)
    held = _held_activations(_fork(), (x,), torch.randn(batch, 4), nn.MSELoss(), batch, plan)
    fc0_input, h, loss = batch * 8 * 4, batch * 16 * 4, 2 * batch * 4 * 4  # loss: input, target
    assert held == fc0_input + held_h * h + loss


def test_cross_entropy_backward_holds_two_logit_sized_gradients():
    """Over a large vocabulary the peak is the loss's backward: the log-probabilities it
    saved, the gradient of them and the logits' gradient, three logit-sized tensors."""
    model = nn.Sequential(nn.Linear(8, 4096))
    batch = 64
    graph = trace_graph(model, torch.randn(2, 8), target=torch.zeros(2, dtype=torch.long),
                        loss_fn=nn.CrossEntropyLoss())
    work = op_work(graph)
    assignment = resolve_precisions(work, {}, load_catalog().device("T4"))
    memory = memory_breakdown(work, graph.params, assignment, batch_size=batch,
                              optimizer="sgd", bucket_bytes=0.0)
    logits, ids = batch * 4096 * 4, batch * 8
    # the loss's own (scalar) output gradient, the logits' and labels' and the inner one
    assert memory["workspace"] == pytest.approx(logits + ids + logits, abs=4 * batch)
    assert memory["activations"] == batch * 8 * 4 + logits + ids  # fc's input, loss


@pytest.mark.parametrize("plan, bytes_per_row", [
    ({}, 8 * 4 + 16 * 4),                    # the input; the ReLU's output, layer 2's too
    ({"0": "fp16"}, 8 * 2 + 16 * 2 + 16 * 4),  # an fp16 copy; the ReLU follows in fp16;
                                             # fp32 layer 2 keeps an fp32 copy of it
    ({"0": "fp16", "2": "fp16"}, 8 * 2 + 16 * 2),  # the fp16 ReLU output, kept by both
    ({"2": "fp16"}, 8 * 4 + 16 * 4 + 16 * 2),      # fp32 ReLU output, layer 2's fp16 copy
])
def test_what_an_op_keeps_is_in_its_own_format_and_shared_when_formats_agree(
        plan, bytes_per_row):
    batch = 1024
    graph = trace_graph(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                        torch.randn(2, 8))
    work = op_work(graph)
    assignment = resolve_precisions(work, plan, load_catalog().device("T4"))
    model = MemoryModel(work, graph.params, optimizer="sgd", bucket_bytes=0.0)
    assert model.saved(assignment, batch_size=batch).sum() == batch * bytes_per_row


@pytest.mark.parametrize("norm, kept_bytes", [(nn.BatchNorm1d(16), 2), (nn.LayerNorm(16), 4)])
def test_a_16_bit_norm_keeps_its_input_as_its_kernel_reads_it(norm, kept_bytes):
    """A bf16 linear writes bf16: a bf16 batch norm keeps that tensor (its kernels read
    16-bit inputs), a bf16 layer norm an fp32 copy (it computes on fp32 inputs)."""
    batch = 1024
    graph = trace_graph(nn.Sequential(nn.Linear(8, 16), norm), torch.randn(2, 8))
    work = op_work(graph)
    model = MemoryModel(work, graph.params, optimizer="sgd", bucket_bytes=0.0)
    a100 = load_catalog().device("A100-SXM4-40GB")
    fp32, bf16 = (model.saved(resolve_precisions(work, plan, a100), batch_size=batch)[1]
                  for plan in ({}, {"0": "bf16", "1": "bf16"}))
    assert fp32 - bf16 == batch * 16 * (4 - kept_bytes)  # its statistics fp32 either way


def test_which_ops_share_a_tensor_travels_in_the_work_not_the_parameter_table():
    """The tensors several ops keep are ``OpWork.saved_tensors`` (the graph's
    ``saved_tensors`` column, owners as op indices): a parameter table built again (read
    back from a file, by hand), with no pandas ``attrs``, holds the same activations."""
    graph = _two_layers()
    work = op_work(graph)
    assert not graph.params.attrs
    input_, relu_out = 2 * 8 * 4, 2 * 16 * 4   # at the traced batch, 2
    assert work.saved_tensors == (((None, input_, input_, True),),   # layer 0: the data
                                  ((1, relu_out, relu_out, True),),  # the ReLU: its output
                                  ((1, relu_out, relu_out, True),))  # layer 2: the same
    params = pd.DataFrame(graph.params.to_dict("list"), index=graph.params.index)
    model = MemoryModel(work, params, optimizer="sgd", bucket_bytes=0.0)
    fp32 = resolve_precisions(work, {}, load_catalog().device("T4"))
    assert model.saved(fp32, batch_size=1024).sum() == 1024 * (8 * 4 + 16 * 4)


def _first_and_split(graph, batch: int):
    work = op_work(graph)
    model = MemoryModel(work, graph.params, optimizer="sgd", bucket_bytes=0.0)
    fp32 = resolve_precisions(work, {}, load_catalog().device("T4"))
    first, split = (dict(zip(work.names, model.saved(fp32, batch_size=batch, split_shared=s)))
                    for s in (False, True))
    assert sum(first.values()) == sum(split.values())
    return first, split


def test_split_shared_counts_a_tensor_in_even_parts_unless_its_writer_keeps_it():
    """fc1 and fc2 keep fc0's output: held at fc1 (the first), or half at each when split
    (what each one's format decides); a ReLU's output that the next layer keeps too is
    the ReLU's either way."""
    batch = 1024
    h = batch * 16 * 4
    first, split = _first_and_split(trace_graph(_fork(), torch.randn(2, 8)), batch)
    assert (first["fc1"], first["fc2"]) == (h, 0) and (split["fc1"], split["fc2"]) == (h / 2, h / 2)
    first, split = _first_and_split(_two_layers(), batch)
    assert (first["1"], first["2"]) == (split["1"], split["2"]) == (h, 0)


def test_an_emulating_rank_holds_fp32_values_but_the_gemms_encoded_operands():
    """On a rank that emulates (the CPU), layer 0 in bf16 keeps a bf16 copy of its input and
    weight (the encoded operands), but writes fp32 values: the ReLU keeps its output in fp32,
    shared with layer 1, and the backward's gradients and products are fp32."""
    graph = _two_layers()
    work = op_work(graph)
    cpu = load_catalog().device("cpu")
    assignment = resolve_precisions(work, {"0": "bf16"}, cpu)
    memory = memory_breakdown(work, graph.params, assignment, batch_size=4, optimizer="sgd",
                              bucket_bytes=0, emulated=True)
    fp32, bf16 = 4, 2
    # peak at layer 0's backward: its bf16 input copy held, every gradient, fp32 workspace:
    # output and input gradients, and its encoded input and weight widened back to fp32
    assert memory == pytest.approx({
        "master_weights": 212 * fp32, "low_precision_weights": (16 * 8 + 16) * bf16,
        "gradients": 212 * fp32, "ddp_buckets": 0, "optimizer_state": 0,
        "activations": 4 * 8 * bf16,
        "workspace": (4 * 16 + 4 * 8) * fp32 + (4 * 8 + 16 * 8 + 16) * fp32})
    held = MemoryModel(work, graph.params, optimizer="sgd", bucket_bytes=0).saved(
        assignment, batch_size=4, emulated=True)
    assert held.tolist() == [4 * 8 * bf16, 4 * 16 * fp32, 0]  # layer 1 shares the ReLU's
    native = MemoryModel(work, graph.params, optimizer="sgd", bucket_bytes=0).saved(
        assignment, batch_size=4)
    assert native.tolist() == [4 * 8 * bf16, 4 * 16 * bf16, 4 * 16 * fp32]


def test_the_simulator_costs_a_cpu_ranks_memory_as_emulated():
    graph = _two_layers()
    cluster = load_cluster("local-cpu")
    sim = simulate(graph, {"cpu": {"0": "bf16"}}, cluster, CostModel())
    work = op_work(graph)
    assignment = resolve_precisions(work, {"0": "bf16"}, cluster.catalog.device("cpu"))
    model = MemoryModel(work, graph.params, optimizer="sgd", bucket_bytes=0)
    batch = cluster.ranks[0].batch_size
    parts = ["activations", "workspace", "low_precision_weights", "gradients"]
    emulated = model.breakdown(assignment, batch_size=batch, emulated=True)
    native = model.breakdown(assignment, batch_size=batch)
    assert sim.memory_breakdown.loc[0, parts].to_dict() == pytest.approx(
        {k: emulated[k] for k in parts})
    assert {k: native[k] for k in parts} != pytest.approx({k: emulated[k] for k in parts})
