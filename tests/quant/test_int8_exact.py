"""The CPU int8 emulation is exactly an int32-accumulating int8 GEMM, and int8 ops save int8.

``torch._int_mm`` runs on the CPU too (slowly), so it is the ground truth here; K > 1040
makes the split-K path run (a single fp32 GEMM is not exact there). The kernels' CUDA
branches (``torch._int_mm``, ``torch._scaled_mm``) are also run here on CPU tensors, so their
reshapes and scale handling are checked without a GPU.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qsync_lab.kernels import quantize_int8
from qsync_lab.quant import apply_plan_, gemm
from qsync_lab.quant.gemm import ConvKernel, LinearKernel, MatMulKernel
from qsync_lab.quant.native import execution


def _codes(*shape, seed=0, low=-127):
    """int8 codes in [low, 127]; a high ``low`` gives large sums that fp32 cannot hold
    exactly beyond K ≈ 1040 (a single fp32 GEMM then rounds)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, 128, shape, generator=g, dtype=torch.int8)


@pytest.mark.parametrize("k", [64, 1100, 2504])
@pytest.mark.parametrize("low", [-127, 101])
def test_linear_emulation_equals_int_mm(k, low):
    a, b = _codes(24, k, seed=1, low=low), _codes(16, k, seed=2, low=low)
    expected = torch._int_mm(a, b.t().contiguous()).float()
    assert torch.equal(LinearKernel().int8_product(a, b), expected)


def test_a_single_fp32_gemm_would_not_be_exact_beyond_k_1040():
    a, b = _codes(24, 2048, seed=0, low=101), _codes(16, 2048, seed=1, low=101)
    exact = torch._int_mm(a, b.t().contiguous()).float()
    assert torch.equal(LinearKernel().int8_product(a, b), exact)
    assert not torch.equal(F.linear(a.float(), b.float()), exact)


def test_batched_matmul_emulation_equals_int_mm():
    a, b = _codes(2, 3, 20, 1100, seed=3, low=101), _codes(3, 1100, 24, seed=4, low=101)
    expected = torch.stack([
        torch.stack([torch._int_mm(a[i, j], b[j]) for j in range(3)]) for i in range(2)
    ]).float()
    assert torch.equal(MatMulKernel().int8_product(a, b), expected)


@pytest.mark.parametrize("channels, groups", [(130, 1), (64, 2), (8, 1)])
def test_conv_emulation_is_exact(channels, groups):
    x = _codes(2, channels, 7, 7, seed=5, low=101)
    w = _codes(12, channels // groups, 3, 3, seed=6, low=101)
    kernel = ConvKernel((1, 1), (1, 1), (1, 1), groups)
    exact = kernel.forward(x.double(), w.double()).float()  # float64 holds every int32 sum
    assert torch.equal(kernel.int8_product(x, w), exact)


def test_qlinear_forward_is_qsync_int8_formula():
    layer = nn.Linear(1100, 24)
    apply_plan_(layer, {"": {"forward": "int8", "granularity": "channel"}})
    x = torch.randn(32, 1100, generator=torch.Generator().manual_seed(7))
    qx, qw = quantize_int8(x), quantize_int8(layer.weight.detach(), axis=0)
    acc = torch._int_mm(qx.codes, qw.codes.t().contiguous()).float()
    expected = acc * (qx.scale * qw.scale) + layer.bias.detach()
    assert torch.equal(layer(x), expected)


def _saved_dtypes(module, *inputs):
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return saved


@pytest.mark.parametrize("precision, dtype", [
    ("int8", torch.int8), ("fp16", torch.float16), ("bf16", torch.bfloat16),
    ("fp8_e4m3", torch.float8_e4m3fn),
])
@pytest.mark.parametrize("module, shape", [
    (nn.Linear(64, 32), (16, 64)), (nn.Conv2d(8, 16, 3), (2, 8, 10, 10)),
])
def test_ops_save_operands_in_their_precision(module, shape, precision, dtype):
    apply_plan_(module, {"": precision})
    x = torch.randn(shape, requires_grad=True)
    saved = _saved_dtypes(module, x)
    big = [d for d, n in saved if n > module.weight.shape[0]]  # scales are small
    assert big == [dtype, dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("module, shape", [
    (nn.Linear(1104, 64), (32, 1104)),  # torch._int_mm path
    (nn.Conv2d(130, 16, 3, padding=1), (2, 130, 8, 8)),  # float64 path
])
def test_cuda_int8_forward_equals_cpu_emulation(module, shape):
    apply_plan_(module, {"": {"forward": "int8", "granularity": "channel"}})
    x = torch.randn(shape, generator=torch.Generator().manual_seed(8))
    cpu = module(x)
    with execution("emulated"):
        assert torch.equal(module.cuda()(x.cuda()).cpu(), cpu)


@pytest.fixture
def cuda_branches(monkeypatch):
    """Route CPU tensors through the GEMM kernels' CUDA branch (``torch._int_mm`` also runs
    on the CPU), as on an sm90 GPU."""
    monkeypatch.setattr(gemm, "cuda_capability", lambda t: (9, 0))


@pytest.mark.parametrize("kernel, a_shape, b_shape", [
    (LinearKernel(), (2, 12, 64), (24, 64)),  # 3-d input flattened to rows
    (MatMulKernel(), (2, 3, 20, 64), (3, 64, 24)),  # batch dims broadcast, one GEMM each
])
def test_cuda_int_mm_branch_is_exact(kernel, a_shape, b_shape, cuda_branches):
    a, b = _codes(*a_shape, seed=9, low=101), _codes(*b_shape, seed=10, low=101)
    exact = kernel.forward(a.double(), b.double()).float()  # float64 holds every int32 sum
    got = kernel.int8_product(a, b)
    assert got.shape == exact.shape and torch.equal(got, exact)
