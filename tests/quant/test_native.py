"""The native path (torch's kernels, as a GPU runs them), checked on the CPU.

torch's CPU kernels stand in for CUDA's: ``execution("native")`` makes CPU operands take the
path CUDA operands take. A dispatch mode records which aten kernels each op calls, in
which dtypes, so these tests see that a bf16 op really multiplies bf16 operands, an int8
op calls ``_int_mm`` and an fp8 op ``_scaled_mm``, without a GPU.
"""

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from qsync_lab.devices import load_catalog
from qsync_lab.graph import trace_graph
from qsync_lab.models import example_batch, get_model, model_spec
from qsync_lab.precision import Precision
from qsync_lab.quant import apply_plan_, apply_resolved_plan_
from qsync_lab.quant import native
from qsync_lab.quant.native import execution, runs_native, set_tf32
from tests.gemm_calls import GemmCalls

#: "native": CPU tensors forced through the native path; "cuda": a GPU as it runs
DEVICES = ["native", pytest.param("cuda", marks=pytest.mark.gpu)]


def _step(model, x, device="native"):
    model, x = model.to(_torch_device(device)), x.to(_torch_device(device)).detach()
    x.requires_grad_(x.is_floating_point())
    with execution("native" if device == "native" else "auto"), GemmCalls() as kernels:
        out = model(x)
        out.float().sum().backward()
    return out, kernels


def _torch_device(device):
    return "cpu" if device == "native" else device


@pytest.fixture
def linear():
    torch.manual_seed(0)
    return nn.Linear(64, 32), torch.randn(48, 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16),
                                              ("fp16", torch.float16)])
def test_half_ops_multiply_in_their_dtype_and_write_it(linear, precision, dtype, device):
    layer, x = linear
    apply_plan_(layer, {"": precision})
    out, kernels = _step(layer, x, device)
    assert out.dtype == dtype
    assert kernels.calls and all(d == (dtype, dtype) for _, d, _ in kernels.calls)
    assert layer.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_int8_ops_call_int_mm_and_compute_their_backward_in_fp16(linear, device):
    layer, x = linear
    apply_plan_(layer, {"": "int8"})
    out, kernels = _step(layer, x, device)
    names = [(name, dtypes) for name, dtypes, _ in kernels.calls]
    assert names[0] == ("_int_mm", (torch.int8, torch.int8))
    assert {d for _, d in names[1:]} == {(torch.float16, torch.float16)}
    assert out.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_ops_call_scaled_mm_with_e4m3_forward_and_e5m2_gradients(linear, device):
    layer, x = linear
    apply_plan_(layer, {"": "fp8_e4m3"})
    _, kernels = _step(layer, x, device)
    forward, *backward = [d for name, d, _ in kernels.calls if name == "_scaled_mm"]
    assert forward == (torch.float8_e4m3fn, torch.float8_e4m3fn)
    assert backward == [(torch.float8_e5m2, torch.float8_e4m3fn)] * 2


class _Launches(TorchDispatchMode):
    """The aten calls that launch work (views, transposes and allocations left out)."""

    METADATA = ("view", "t", "expand", "detach", "empty", "_unsafe_view", "alias")

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.METADATA:
            self.calls.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision, forward, backward", [("int8", 11, 9), ("fp8_e4m3", 9, 11)])
def test_quantized_linears_scale_both_operands_in_shared_launches(linear, precision, forward,
                                                                  backward):
    """One multi-tensor norm, division and floor give both operands' scales; one rounding
    launch both int8 codes; the int8 backward dequantizes straight into its float dtype."""
    layer, x = linear
    apply_plan_(layer, {"": precision})
    x.requires_grad_(True)
    with execution("native"):
        with _Launches() as forward_calls:
            out = layer(x)
        loss = out.sum()
        with _Launches() as backward_calls:
            loss.backward()
    assert forward_calls.calls.count("_foreach_norm") == 1
    assert len(forward_calls.calls) == forward, forward_calls.calls
    assert len(backward_calls.calls) - 1 == backward, backward_calls.calls  # - the loss's


@pytest.mark.parametrize("device", DEVICES)
def test_tf32_switches_are_on_around_tf32_ops_only(linear, device):
    layer, x = linear
    fp32 = copy.deepcopy(layer)
    apply_plan_(layer, {"": "tf32"})
    apply_plan_(fp32, {"": {"forward": "fp32", "backward": "tf32"}})
    _, tf32_kernels = _step(layer, x, device)
    _, mixed_kernels = _step(fp32, x, device)
    # forward, input gradient, weight gradient
    assert [on for *_, on in tf32_kernels.calls] == [True, True, True]
    assert [on for *_, on in mixed_kernels.calls] == [False, True, True]
    assert not torch.backends.cuda.matmul.allow_tf32  # restored


@pytest.fixture
def tf32_off():
    """The switches as a rank with fp32 GEMMs has them (off), restored after the test."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    set_tf32(False)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("device", DEVICES)
def test_tf32_ops_switch_their_backward_by_hooks_and_leave_fp32_ops_alone(device, tf32_off):
    """In a step of tf32, fp32 and tf32 layers the backward of each GEMM sees its own
    layer's switch, though autograd runs them (autograd's own nodes, no function)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8))
    apply_plan_(model, {"0": "tf32", "2": "tf32"})
    out, kernels = _step(model, torch.randn(4, 3, 16), device)
    # forward 0, 1, 2; backward 2, 1, 0 (two gradients each)
    assert [on for *_, on in kernels.calls] == [True, False, True, True, True, False, False,
                                                True, True]
    assert not torch.backends.cuda.matmul.allow_tf32  # restored
    assert out.grad_fn.name() == "ViewBackward0"  # torch's nodes, not an autograd function


@pytest.mark.parametrize("device", DEVICES)
def test_under_tf32_kept_on_tf32_ops_run_as_plain_ops(linear, device, tf32_off, monkeypatch):
    layer, x = linear
    apply_plan_(layer, {"": "tf32"})
    set_tf32(True)
    monkeypatch.setattr(native, "_tf32_switched", None)  # nothing to switch: never called
    out, kernels = _step(layer, x, device)
    assert [on for *_, on in kernels.calls] == [True, True, True]
    assert out.grad_fn.name() == "AddmmBackward0"
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


def test_tf32_ops_whose_product_node_is_not_found_switch_through_a_function(
        linear, monkeypatch, tf32_off):
    layer, x = linear
    reference = copy.deepcopy(layer)
    apply_plan_(layer, {"": "tf32"})
    monkeypatch.setattr(native, "_PRODUCT_NODES", frozenset())
    out, kernels = _step(layer, x)
    # the forward whose node was not found, the function's forward, its two gradients
    assert [on for *_, on in kernels.calls] == [True, True, True, True]
    assert out.grad_fn.name() == "_NativeFloatBackward"
    _step(reference, x)
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.Linear(8, 5), (3, 8)), (lambda: nn.Linear(8, 5, bias=False), (2, 3, 8)),
    (lambda: nn.Conv2d(4, 8, 3, padding=1), (2, 4, 6, 6))])
def test_tf32_ops_compute_the_gradients_of_their_fp32_module(make, shape, tf32_off):
    """On the CPU a tf32 product is an fp32 one: the hooked path gives fp32's gradients."""
    torch.manual_seed(0)
    reference, x = make(), torch.randn(*shape)
    planned = copy.deepcopy(reference)
    apply_plan_(planned, {"": "tf32"})
    for model in (reference, planned):
        _step(model, x)
    for want, got in zip(reference.parameters(), planned.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_tf32_convolutions_run_with_cudnn_tf32_on(device):
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 8, 3)
    apply_plan_(conv, {"": "tf32"})
    before, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
    try:
        _, kernels = _step(conv, torch.randn(2, 4, 8, 8), device)
        assert not torch.backends.cudnn.allow_tf32  # restored after the op
    finally:
        torch.backends.cudnn.allow_tf32 = before
    assert kernels.calls and all(on for *_, on in kernels.calls)


class _Context:
    """What an autograd function's forward and backward use of their context."""

    needs_input_grad = (True, True, False, False, False)

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


@pytest.mark.parametrize("function, options", [
    (native._NativeFp8Linear, (Precision.FP8_E5M2,)),
    (native._NativeInt8Linear, (False, Precision.BF16))])
def test_quantized_linears_give_cublaslt_its_layouts_for_transposed_operands(
        function, options, monkeypatch):
    """torch's fake CUDA tensors run ``_scaled_mm``'s layout checks (row-major first
    operand, column-major second) without a GPU: a transposed weight view (GPT-2's
    ``Conv1D`` passes ``weight.t()``), a transposed input and gradient, forward and
    backward (called directly: autograd's engine needs a real device)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qsync_lab.quant import gemm

    monkeypatch.setattr(gemm, "_capability", lambda index: (9, 0))  # an H100
    with FakeTensorMode():
        x = torch.empty(64, 32, device="cuda").t()  # 32 x 64, column-major
        weight = torch.empty(64, 48, device="cuda").t()  # 48 x 64, a transposed view
        ctx = _Context()
        out = function.forward(ctx, x, weight, None, *options)
        grad_x, grad_w, *_ = function.backward(ctx, torch.empty(48, 32, device="cuda").t())
        for tensor in (*ctx.saved_tensors[::2], grad_x, grad_w):  # codes and gradients
            assert tensor.is_cuda
        assert out.shape == (32, 48) and grad_x.shape == x.shape and grad_w.shape == weight.shape
    if function is native._NativeInt8Linear:  # _int_mm's operands: row-major, then its .t()
        x_codes, _, w_codes, _ = ctx.saved_tensors
        assert x_codes.is_contiguous() and w_codes.is_contiguous()


def test_pairs_without_native_kernels_fall_back_to_the_emulation():
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 8, 3)
    apply_plan_(conv, {"": "int8"})
    _, kernels = _step(conv, torch.randn(2, 4, 8, 8))
    assert all(torch.int8 not in d for _, d, _ in kernels.calls)  # codes widened to float


def test_execution_is_chosen_by_device_unless_forced():
    cpu = torch.zeros(1)
    assert not runs_native(cpu)
    with execution("native"):
        assert runs_native(cpu)
        with execution("emulated"):
            assert not runs_native(cpu)
    with pytest.raises(Exception, match="unknown execution 'fast'"):
        with execution("fast"):
            pass


class _Chain(nn.Module):
    """A bf16 linear feeding an fp32 linear, an fp32 layer norm and an fp32 functional
    matmul: each must widen the bf16 tensor it is given."""

    def __init__(self):
        super().__init__()
        self.low, self.high, self.norm = nn.Linear(16, 16), nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x):
        y = self.low(x)
        return self.norm(self.high(y)) + (y @ self.high.weight).sum(-1, keepdim=True)


def test_fp32_ops_fed_by_native_half_ops_get_fp32_inputs():
    torch.manual_seed(0)
    model, x = _Chain(), torch.randn(4, 16)
    graph = trace_graph(model, x)
    with execution("native"):
        with pytest.raises(RuntimeError, match="dtype"):  # unguarded, the dtypes clash
            _check_clash(model, x)
        apply_resolved_plan_(model, graph, {"low": "bf16"},
                             load_catalog().device("A100-SXM4-80GB"))
        out = model(x)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def _check_clash(model, x):
    """The bf16 linear alone, its output into the fp32 linear: torch refuses the mix."""
    planned = copy.deepcopy(model)
    apply_plan_(planned, {"low": "bf16"})
    planned.high(planned.low(x))


@pytest.mark.parametrize("device", DEVICES)
def test_native_bf16_bert_launches_at_most_1_2x_autocasts_kernels(device):
    """A bf16 plan of every GEMM of a small BERT, natively, against torch.autocast (bf16):
    aten calls per forward+backward (on the CPU, its count of a GPU's kernel launches)."""
    torch.manual_seed(0)
    kwargs = {"seq_len": 16, "vocab_size": 500}
    where = _torch_device(device)
    model = get_model("bert_mini", **kwargs)
    inputs, target = example_batch("bert_mini", 4, **kwargs)
    loss_fn = model_spec("bert_mini").loss_fn()
    graph = trace_graph(model, inputs, target=target, loss_fn=loss_fn)
    model, inputs, target = model.to(where), [t.to(where) for t in inputs], target.to(where)
    gemms = graph.ops.index[graph.ops.kind.isin(["linear", "matmul"])]
    planned = copy.deepcopy(model)
    apply_resolved_plan_(planned, graph, {fqn: "bf16" for fqn in gemms},
                         load_catalog().device("A100-SXM4-80GB"))

    def count(step):
        with GemmCalls() as kernels:
            step()
        return kernels

    def ours():
        with execution("native" if device == "native" else "auto"):
            loss_fn(planned(*inputs).float(), target).backward()

    def autocast():
        with torch.autocast(where, dtype=torch.bfloat16):
            out = model(*inputs)
        loss_fn(out.float(), target).backward()

    native, reference = count(ours), count(autocast)
    assert {d for _, d, _ in native.calls} == {(torch.bfloat16, torch.bfloat16)}
    assert native.count <= 1.2 * reference.count, (native.count, reference.count)


@pytest.mark.parametrize("make, shape", [(lambda: nn.Conv2d(4, 8, 3, padding=1), (2, 4, 6, 6)),
                                         (lambda: nn.Linear(8, 5), (3, 2, 8))])
def test_split_precision_ops_compute_the_reference_gradients(make, shape):
    """A forward/backward split (torch's autograd function path, one backward call for
    both operands) gives the fp32 gradients when both passes compute in fp32 math (TF32
    is CUDA's: on the CPU a tf32 product is an fp32 one)."""
    torch.manual_seed(0)
    reference, x = make(), torch.randn(*shape)
    planned = copy.deepcopy(reference)
    apply_plan_(planned, {"": {"forward": "fp32", "backward": "tf32"}})
    grads = []
    for model in (reference, planned):
        inputs = x.clone().requires_grad_()
        with execution("native"):
            model(inputs).square().sum().backward()
        grads.append([inputs.grad, *(p.grad for p in model.parameters())])
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
