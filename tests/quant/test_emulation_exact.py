"""The CPU emulation of a low-precision matmul, forward and backward, bit for bit.

Each reference below is the textbook formula in torch casts: operands rounded to the format
(fp8: divided by their per-tensor scale first), products and sums in fp32, the output
rounded to fp16/bf16 (int8 and fp8: rescaled), and the same for both gradients with the
output gradient in the backward precision. The fused kernels the runtime uses instead
(rounding in place, scaled casts that also widen, dequantizing into fp16) must give the
same bits.
"""

import pytest
import torch

from qsync_lab.kernels import absmax, quantize_int8
from qsync_lab.models import MatMul
from qsync_lab.quant import apply_plan_, encoding

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True, params=["torch casts", "one-pass kernels"])
def cast_path(request, monkeypatch):
    """Run every test on both CPU paths: torch's casts (small tensors) and the one-pass
    kernels that large tensors take (the size threshold lowered to 0)."""
    if request.param == "one-pass kernels":
        monkeypatch.setattr(encoding, "ONE_PASS_MIN", 0)
    return request.param


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(2, 3, 16, 24, generator=g), torch.randn(2, 3, 24, 20, generator=g)
    return a, b, torch.randn(2, 3, 16, 20, generator=g)


def _run(plan, a, b, grad):
    op = MatMul()
    apply_plan_(op, {"": plan})
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = op(a, b)
    out.backward(grad)
    return out.detach(), a.grad, b.grad


def _float_reference(a, b, grad, dtype):
    def r(t):
        return t.to(dtype).float()

    g = r(grad)
    return r(r(a) @ r(b)), r(g @ r(b).mT), r(r(a).mT @ g)


def _fp8_reference(a, b, grad):
    def cast(t, dtype):
        scale = absmax(t) / torch.finfo(dtype).max
        return (t / scale).to(dtype).float(), scale

    (a8, sa), (b8, sb) = cast(a, torch.float8_e4m3fn), cast(b, torch.float8_e4m3fn)
    g8, sg = cast(grad, torch.float8_e5m2)
    return (a8 @ b8) * (sa * sb), (g8 @ b8.mT) * (sg * sb), (a8.mT @ g8) * (sa * sg)


def _int8_reference(a, b, grad, channel):
    qa = quantize_int8(a, axis=-2 if channel else None)
    qb = quantize_int8(b, axis=-1 if channel else None)
    sa = qa.scale.reshape(-1, 1) if channel else qa.scale
    out = (qa.codes.float() @ qb.codes.float()) * (sa * qb.scale)
    a16, b16 = ((q.codes.float() * s).half().float() for q, s in ((qa, sa), (qb, qb.scale)))
    g16 = grad.half().float()
    return out, (g16 @ b16.mT).half().float(), (a16.mT @ g16).half().float()


def _assert_bits_equal(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.float32
        assert torch.equal(g.view(torch.int32), w.view(torch.int32))


@pytest.mark.parametrize("name", list(DTYPES))
def test_fp16_bf16_matmul_is_the_rounded_fp32_product(name):
    a, b, grad = _inputs()
    _assert_bits_equal(_run(name, a, b, grad), _float_reference(a, b, grad, DTYPES[name]))


@pytest.mark.parametrize("channel", [False, True])
def test_int8_matmul_is_the_int32_product_and_fp16_backward(channel):
    a, b, grad = _inputs(1)
    plan = {"forward": "int8", "granularity": "channel" if channel else "tensor"}
    _assert_bits_equal(_run(plan, a, b, grad), _int8_reference(a, b, grad, channel))


def test_fp8_matmul_is_the_rescaled_product_of_scaled_casts():
    a, b, grad = _inputs(2)
    _assert_bits_equal(_run("fp8_e4m3", a, b, grad), _fp8_reference(a, b, grad))


def test_broadcast_batch_gradient_is_summed_then_rounded():
    a, b, grad = _inputs(3)
    b = b[0, 0]  # (24, 20), broadcast over both batch dimensions
    r = (lambda t: t.half().float())
    g = r(grad)
    want = r(r(a) @ r(b)), r(g @ r(b).mT), r((r(a).mT @ g).sum((0, 1)))
    _assert_bits_equal(_run("fp16", a, b, grad), want)
