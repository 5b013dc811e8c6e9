"""``out=`` arguments, the fused NaN check of a given-scale quantize, format-specialised kernels."""

import numpy as np
import pytest
import torch

from qsync_lab.errors import QSyncError
from qsync_lab.kernels import (
    aps_quantize,
    cgx_encode,
    dequantize_int8,
    fake_quantize_int8,
    float_encode,
    float_quantize,
    float_round,
    floatfmt,
    qsgd_encode,
    quantize_int8,
    reference,
)

TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
         "fp8_e5m2": torch.float8_e5m2}


def _x(shape=(6, 40), dtype=torch.float32):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)


def _bits(t):
    return t.contiguous().view(torch.uint8 if t.dtype.itemsize == 1 else
                               torch.int16 if t.dtype.itemsize == 2 else torch.int32)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_out_matches_allocating_call_and_is_returned(backend):
    x = _x()
    codes = torch.empty(x.shape, dtype=torch.int8)
    for kw in ({}, {"scale": torch.tensor(0.05)}, {"rounding": "stochastic", "seed": 4},
               {"axis": 0}):
        q = quantize_int8(x, backend=backend, out=codes, **kw)
        assert q.codes is codes
        assert torch.equal(codes, quantize_int8(x, backend=backend, **kw).codes)
    q = quantize_int8(x)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(x.shape, dtype=dtype)
        assert dequantize_int8(q.codes, q.scale, dtype=dtype, backend=backend, out=out) is out
        assert torch.equal(out, dequantize_int8(q.codes, q.scale, dtype=dtype, backend=backend))
    for dtype in (torch.float32, torch.float16):
        xd = x.to(dtype)
        out = torch.empty(x.shape, dtype=dtype)
        r = fake_quantize_int8(xd, backend=backend, out=out)
        assert r.output is out and torch.equal(out, fake_quantize_int8(xd, backend=backend).output)
    for name, dtype in TORCH.items():
        out = torch.empty(x.shape, dtype=dtype)
        assert float_encode(x, name, backend=backend, out=out) is out
        assert torch.equal(_bits(out), _bits(x.to(dtype)))
    out = torch.empty(x.shape)
    assert float_round(x, (4, 3), backend=backend, out=out) is out
    assert torch.equal(out, float_round(x, (4, 3), backend=backend))
    assert aps_quantize(x, 3, (5, 2), backend=backend, out=out) is out
    assert torch.equal(out, aps_quantize(x, 3, (5, 2), backend=backend))


def test_float_round_in_place():
    x = _x()
    want = float_round(x, "fp8_e4m3")
    y = x.clone()
    assert float_round(y, "fp8_e4m3", out=y) is y
    assert torch.equal(y, want)


@pytest.mark.parametrize(
    "out",
    [torch.empty(6, 41, dtype=torch.int8), torch.empty(6, 40, dtype=torch.uint8),
     torch.empty(40, 6, dtype=torch.int8).t(), np.zeros((6, 40), np.int8)],
)
def test_bad_out_raises_one_line(out):
    with pytest.raises(QSyncError) as err:
        quantize_int8(_x(), out=out)
    assert "\n" not in str(err.value) and "out" in str(err.value)


def test_bad_out_dtype_for_casts_and_dequantize():
    x = _x()
    with pytest.raises(QSyncError, match="float8_e4m3fn"):
        float_encode(x, "fp8_e4m3", out=torch.empty(x.shape, dtype=torch.float8_e5m2))
    with pytest.raises(QSyncError, match="bfloat16"):
        dequantize_int8(quantize_int8(x).codes, 1.0, dtype=torch.bfloat16, out=torch.empty(x.shape))
    with pytest.raises(QSyncError, match="float16"):
        fake_quantize_int8(x.half(), out=torch.empty(x.shape))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_given_scale_finds_nan_in_the_same_pass(bad, rounding):
    x = _x().reshape(-1)
    x[123] = bad
    for backend in ("cpu", "reference"):
        with pytest.raises(QSyncError, match="NaN or Inf"):
            quantize_int8(x, scale=torch.tensor(0.1), rounding=rounding, backend=backend)


def test_large_outputs_equal_small_path():
    # >= 4 MiB outputs take the huge-page allocation path and the specialised kernels
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1))
    q = quantize_int8(x)
    assert torch.equal(q.codes, quantize_int8(x, backend="reference").codes)
    assert torch.equal(dequantize_int8(q.codes, q.scale), q.codes.float() * q.scale)


def _edge_bits():
    rand = np.random.default_rng(5).integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    edge = np.array([0.0, 1e-45, 1.17e-38, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 6.1e-5, 432.0,
                     448.0, 464.0, 465.0, 57344.0, 61440.0, 65504.0, 65520.0, 3.4028235e38,
                     np.inf, np.nan], dtype=np.float32).view(np.uint32)
    special = np.array([0x7F800001, 0x7FFFFFFF, 0x7FC00000, 0x007FFFFF, 0x477FF000], np.uint32)
    x = np.concatenate([rand, edge, special])
    return torch.from_numpy(np.concatenate([x, x | np.uint32(0x80000000)]).view(np.float32))


def test_specialised_format_kernels_bit_exact(monkeypatch):
    from qsync_lab.kernels import cpu

    monkeypatch.setattr(cpu.floats, "SPECIALIZE_MIN", 0)
    x = _edge_bits()
    for name, dtype in TORCH.items():
        assert torch.equal(_bits(float_encode(x, name)), _bits(x.to(dtype)))
        got = float_round(x, name).numpy()
        want = x.to(dtype).float().numpy()
        nan = np.isnan(want)
        assert (np.isnan(got) == nan).all()
        assert (got[~nan].view(np.uint32) == want[~nan].view(np.uint32)).all()
    for fmt in [(5, 2), (2, 0)]:
        want = reference.round_scaled(x.numpy(), 8.0, 1.0, floatfmt.ieee_format(*fmt))
        got = aps_quantize(x, 3, fmt).numpy()
        assert (got.view(np.uint32) == want.view(np.uint32)).all()


def test_scalar_encode_handles_nan_without_mantissa_bits():
    # branch-free: every lane computes the NaN code, so M = 0 must not shift by -1
    code = floatfmt.encode(0x7FC00000, floatfmt.ieee_format(3, 0))
    assert int(code) == 0b0111
    assert int(floatfmt.round_bits(0x7FC00001, floatfmt.ieee_format(3, 0))) == 0x7FC00001


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_compressor_out_matches_allocating_call(backend):
    """cgx_encode, qsgd_encode and float_quantize write the given buffers, bit for bit what
    the allocating call returns."""
    x = _x((7, 100))
    for bits, group in ((4, 512), (3, 100), (8, 64)):
        groups, blocks = -(-x.numel() // group), -(-x.numel() // 8)
        out = (torch.empty(blocks, bits, dtype=torch.uint8), torch.empty(groups, 2))
        packed = cgx_encode(x, bits, group, seed=5, backend=backend, out=out)
        fresh = cgx_encode(x, bits, group, seed=5, backend=backend)
        assert packed.payload.data_ptr() == out[0].data_ptr()
        assert packed.meta.data_ptr() == out[1].data_ptr()
        assert torch.equal(out[0], fresh.payload) and torch.equal(out[1], fresh.meta)
    codes = torch.empty(x.shape, dtype=torch.int8)
    assert qsgd_encode(x, 15, seed=2, backend=backend, out=codes).codes is codes
    assert torch.equal(codes, qsgd_encode(x, 15, seed=2, backend=backend).codes)
    out = (torch.empty(x.shape, dtype=torch.float8_e5m2), torch.empty(x.shape))
    q = float_quantize(x, "fp8_e5m2", scale=0.25, backend=backend, out=out)
    fresh = float_quantize(x, "fp8_e5m2", scale=0.25, backend=backend)
    assert q.codes.data_ptr() == out[0].data_ptr() and q.values.data_ptr() == out[1].data_ptr()
    assert torch.equal(_bits(out[0]), _bits(fresh.codes)) and torch.equal(out[1], fresh.values)


def test_compressor_bad_out_raises_one_line():
    x = _x((4, 64))
    with pytest.raises(QSyncError, match="out meta must be a contiguous torch.float32 tensor "
                                         r"of shape \(1, 2\)") as err:
        cgx_encode(x, 4, 512, out=(torch.empty(32, 4, dtype=torch.uint8), torch.empty(2, 2)))
    assert "\n" not in str(err.value)
    with pytest.raises(QSyncError, match="out payload"):
        cgx_encode(x, 4, 512, out=(torch.empty(32, 8, dtype=torch.uint8), torch.empty(1, 2)))
    with pytest.raises(QSyncError, match="must be a contiguous torch.int8"):
        qsgd_encode(x, 15, out=torch.empty(x.shape))
    with pytest.raises(QSyncError, match="out values"):
        float_quantize(x, "bf16", out=(torch.empty(x.shape, dtype=torch.bfloat16),
                                       torch.empty(3)))
