"""CUDA kernels against the reference: in Numba's simulator by default, on a GPU with --gpu.

Inputs stay tiny (the simulator runs one Python thread per CUDA thread). With ``--gpu`` the
same checks run on CUDA tensors.
"""

import numpy as np
import pytest
import torch

from qsync_lab import kernels as K

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _device(request):
    return "cuda" if request.config.getoption("--gpu") else "cpu"


@pytest.fixture
def dev(request):
    return _device(request)


def _x(n=300, shape=None, seed=0, dtype=torch.float32, dev="cpu"):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 2
    return (x.reshape(shape) if shape else x).to(dtype).to(dev)


@pytest.mark.parametrize("axis", [None, 0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_absmax(axis, dtype, dev):
    x = _x(shape=(10, 30), dtype=dtype, dev=dev)
    x[3, 4] = -100
    assert torch.equal(K.absmax(x, axis, backend="cuda").cpu(), K.absmax(x.cpu(), axis, backend="reference"))


@pytest.mark.parametrize("axis", [None, 1])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantize_dequantize_fake_quantize(axis, rounding, dev):
    x = _x(shape=(12, 25), dev=dev)
    a = K.quantize_int8(x, axis=axis, rounding=rounding, seed=9, backend="cuda")
    b = K.quantize_int8(x.cpu(), axis=axis, rounding=rounding, seed=9, backend="reference")
    assert torch.equal(a.codes.cpu(), b.codes)
    da = K.dequantize_int8(a.codes, a.scale, axis=axis, backend="cuda")
    assert torch.equal(da.cpu(), K.dequantize_int8(b.codes, b.scale, axis=axis, backend="reference"))
    fa = K.fake_quantize_int8(x.to(torch.bfloat16), axis=axis, rounding=rounding, seed=9, backend="cuda")
    fb = K.fake_quantize_int8(x.cpu().to(torch.bfloat16), axis=axis, rounding=rounding, seed=9, backend="reference")
    assert torch.equal(fa.output.cpu(), fb.output)
    assert fa.sse == pytest.approx(fb.sse, rel=1e-12)


def test_zero_tensor(dev):
    z = torch.zeros(40, device=dev)
    q = K.quantize_int8(z, rounding="stochastic", backend="cuda")
    assert not q.codes.any() and not torch.isnan(K.fake_quantize_int8(z, backend="cuda").output).any()


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_float_encode_and_round(fmt, dev):
    edge = torch.tensor([0.0, -0.0, 1e-45, 2.0**-10, 1.5 * 2.0**-10, 448.0, 464.0, 61440.0, 65520.0,
                         3.4e38, float("inf"), -float("inf"), float("nan")])  # fmt: skip
    x = torch.cat([edge, _x(200) * 100, _x(100, seed=1) * 1e-4]).to(dev)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16,
             "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]  # fmt: skip
    view = torch.uint8 if dtype.itemsize == 1 else torch.int16
    # against the reference (which the CPU tests check against torch's casts at the pinned
    # torch version; torch 2.11 turned e4m3 overflow into NaN, later versions saturate)
    got = K.float_encode(x, fmt, backend="cuda").cpu()
    assert torch.equal(got.view(view), K.float_encode(x.cpu(), fmt, backend="reference").view(view))
    scaled = K.float_encode(x, fmt, scale=0.37, backend="cuda").cpu()
    quotient = (x / torch.tensor(0.37, device=dev)).cpu()  # the device's NaN bits
    want = K.float_encode(quotient, fmt, backend="reference")
    assert torch.equal(scaled.view(view), want.view(view))
    r = K.float_round(x, fmt, backend="cuda").cpu()
    want = K.float_round(x.cpu(), fmt, backend="reference")
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(r), nan) and torch.equal(r[~nan], want[~nan])


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_float_quantize_and_decode(fmt, dev):
    # no NaN: a GPU's division makes every NaN canonical (test_float_codes checks them)
    edge = torch.tensor([0.0, -0.0, 1e-45, 448.0, 7e4, 3.4e38, float("inf")])
    x = torch.cat([edge, -edge, _x(200) * 100]).to(dev)
    scale = torch.tensor(2.5, device=dev)  # > 1: no overflow warning in the simulator
    a = K.float_quantize(x, fmt, scale=scale, backend="cuda")
    b = K.float_quantize(x.cpu(), fmt, scale=scale.cpu(), backend="reference")
    view = torch.uint8 if a.codes.dtype.itemsize == 1 else torch.int16
    assert torch.equal(a.codes.cpu().view(view), b.codes.view(view))
    assert torch.equal(a.values.cpu().view(torch.int32), b.values.view(torch.int32))
    got = K.float_decode(a.codes, backend="cuda").cpu()
    assert torch.equal(got.view(torch.int32), b.values.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e5m2])
def test_float_decode_sum(dtype, dev):
    x = torch.stack([_x(300, seed=r) * 50 for r in range(3)]).to(dtype)
    want = K.float_decode_sum(x[:, 5:], scale=0.25, backend="reference")
    got = K.float_decode_sum(x.to(dev)[:, 5:], scale=0.25, backend="cuda").cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_dequantize_int8_sum(dev):
    """Rows read in place behind a header; on a GPU a fused multiply-add may round each
    product once instead of twice (within one float32 rounding of each term)."""
    payloads = torch.randint(-127, 128, (3, 4 + 300), dtype=torch.int8,
                             generator=torch.Generator().manual_seed(0))
    scales = [0.37, 1e-3, 5.0]
    want = K.dequantize_int8_sum(payloads[:, 4:], scales, divisor=3, backend="reference")
    got = K.dequantize_int8_sum(payloads.to(dev)[:, 4:], scales, divisor=3,
                                backend="cuda").cpu()
    if dev == "cpu":  # the simulator computes in NumPy float32: bit for bit
        assert torch.equal(got, want)
    else:
        bound = 3 * 127 * max(scales) * 2.0**-24
        torch.testing.assert_close(got, want, rtol=0, atol=bound)


@pytest.mark.parametrize("axis", [None, 1])
def test_dequantize_into_a_float_format(axis, dev):
    q = K.quantize_int8(_x(shape=(12, 25), dev=dev) * 1e3, axis=axis, backend="cuda")
    a = K.dequantize_int8(q.codes, q.scale, axis=axis, fmt="fp16", backend="cuda")
    b = K.dequantize_int8(q.codes.cpu(), q.scale.cpu(), axis=axis, fmt="fp16",
                          backend="reference")
    assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("fmt", [(3, 0), (4, 3), (6, 5)])
def test_float_round_generic_and_aps(fmt, dev):
    x = torch.cat([_x(200) * 30, torch.tensor([248.0, 1e-42, 0.0])]).to(dev)
    got = K.float_round(x, fmt, backend="cuda").cpu()
    want = K.float_round(x.cpu(), fmt, backend="reference")
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    shift = K.aps_shift(K.aps_exponent(x, 4), fmt)
    y = K.aps_quantize(x, shift, fmt, backend="cuda")
    assert torch.equal(y.cpu(), K.aps_quantize(x.cpu(), shift, fmt, backend="reference"))
    assert torch.equal(K.aps_dequantize(y, shift, backend="cuda").cpu(), K.aps_dequantize(y.cpu(), shift, backend="reference"))


@pytest.mark.parametrize("dithering", ["standard", "exponential"])
def test_global_qsgd(dithering, dev):
    x = _x(300, dev=dev)
    m = float(x.abs().max())
    a = K.global_qsgd_encode(x, m, 4, dithering=dithering, seed=3, backend="cuda")
    b = K.global_qsgd_encode(x.cpu(), m, 4, dithering=dithering, seed=3, backend="reference")
    assert torch.equal(a.cpu(), b)
    da = K.global_qsgd_decode(a, m, 4, dithering=dithering, backend="cuda")
    assert torch.equal(da.cpu(), K.global_qsgd_decode(b, m, 4, dithering=dithering, backend="reference"))


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_cgx(bits, dev):
    x = _x(203, dev=dev)
    a = K.cgx_encode(x, bits, 50, seed=4, backend="cuda")
    b = K.cgx_encode(x.cpu(), bits, 50, seed=4, backend="reference")
    assert torch.equal(a.payload.cpu(), b.payload) and torch.equal(a.meta.cpu(), b.meta)
    assert torch.equal(K.cgx_decode(a, backend="cuda").cpu(), K.cgx_decode(b, backend="reference"))


def test_cgx_decode_mean(dev):
    parts = [K.cgx_encode(_x(203, dev=dev) * s, 4, 50, seed=s, backend="cuda") for s in (1, 2, 3)]
    want = K.cgx_decode_mean([p._replace(payload=p.payload.cpu(), meta=p.meta.cpu())
                              for p in parts], backend="reference")
    assert torch.equal(K.cgx_decode_mean(parts, backend="cuda").cpu(), want)


def test_cgx_marks_non_finite_groups(dev):
    x = _x(150, dev=dev)
    x[60] = float("nan")
    meta = K.cgx_encode(x, 4, 50, check_finite=False, backend="cuda").meta.cpu()
    assert torch.isfinite(meta).all(dim=1).tolist() == [True, False, True]


def test_qsgd_and_norm(dev):
    x = _x(300, dev=dev)
    norm = K.l2norm(x, backend="cuda")
    assert norm == pytest.approx(float(np.linalg.norm(x.cpu().double().numpy())), rel=1e-12)
    a = K.qsgd_encode(x, 6, seed=2, norm=norm, backend="cuda")
    b = K.qsgd_encode(x.cpu(), 6, seed=2, norm=norm, backend="reference")
    assert torch.equal(a.codes.cpu(), b.codes)


def test_launchers_with_the_scalar_on_the_device(dev):
    """The ``_dev`` launchers (issue 36: a scale or Global-QSGD's max read from a device
    array, not the host) give their namesakes' results bit for bit."""
    from qsync_lab.kernels import floats
    from qsync_lab.kernels.plumbing import _arr, _cuda, _rows_in_place
    from qsync_lab.kernels.rng import rng_key

    k = _cuda()
    x = _x(300, seed=5, dev=dev)
    m = x.abs().max().reshape(1)
    codes = torch.empty(300, dtype=torch.uint8, device=dev)
    k.exp_dither_encode_dev(_arr(x), _arr(m), rng_key(3), _arr(codes))
    want = K.global_qsgd_encode(x.cpu(), float(m), 1, dithering="exponential", seed=3,
                                backend="reference")
    assert torch.equal(codes.cpu(), want)
    values = torch.empty(300, device=dev)
    k.exp_dither_decode_dev(_arr(codes), _arr(m), _arr(values))
    assert torch.equal(values.cpu(), K.global_qsgd_decode(want, float(m), 1,
                                                          dithering="exponential",
                                                          backend="reference"))
    rows = torch.stack([_x(300, seed=r) * 50 for r in range(3)]).to(torch.float8_e5m2).to(dev)
    flat, stride = _rows_in_place(rows[:, 5:])
    total = torch.empty(295, device=dev)
    scale = torch.tensor([0.25], device=dev)
    k.float_decode_sum_dev(floats._code_array(flat), 3, stride,
                           _arr(floats._decode_table(rows.dtype, rows.device)), _arr(scale),
                           _arr(total))
    want = K.float_decode_sum(rows.cpu()[:, 5:], scale=0.25, backend="reference")
    assert torch.equal(total.cpu().view(torch.int32), want.view(torch.int32))


@pytest.mark.gpu
def test_real_gpu_auto_backend_uses_cuda():
    x = _x(1 << 20, dev="cuda")
    q = K.quantize_int8(x, rounding="stochastic", seed=1)
    assert q.codes.is_cuda
    assert torch.equal(q.codes.cpu(), K.quantize_int8(x.cpu(), rounding="stochastic", seed=1).codes)


@pytest.mark.gpu
def test_kernels_run_on_torchs_current_stream():
    """Inside a side stream the kernels wait for the torch work queued before them and the
    torch work after them waits for the kernels (the side stream is busy for ~50 ms first,
    so a kernel on another stream would read the input before it is written)."""
    x = _x(1 << 22, dev="cuda")
    y = torch.zeros_like(x)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        y.copy_(x)
        half = K.float_encode(y, "fp16").float()
        norm = K.l2norm(y)
    side.synchronize()
    assert torch.equal(half.cpu(), x.cpu().half().float())
    assert norm == pytest.approx(float(np.linalg.norm(x.cpu().double().numpy())), rel=1e-12)
