"""Widening float formats, the fused scaled cast, dequantizing into a float format, and the
``round_wide`` twin (E = 8 formats) of ``round_bits``."""

import numpy as np
import pytest
import torch
from numba import njit, prange

from qsync_lab.errors import QSyncError
from qsync_lab.kernels import (
    cpu,
    dequantize_int8,
    float_decode,
    float_decode_sum,
    float_encode,
    float_quantize,
    float_round,
    floatfmt,
    quantize_int8,
)

FORMATS = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
SPECIAL = [0.0, -0.0, 1e-45, -3e-6, 1e-8, 2.0**-10, 448.0, 464.0, 6e4, 7e4, 3.4e38,
           float("inf"), float("-inf"), float("nan"), -float("nan")]  # fmt: skip


def _bits(t):
    return t.contiguous().view(torch.uint8 if t.dtype.itemsize == 1 else
                               torch.int16 if t.dtype.itemsize == 2 else torch.int32)


def _all_codes(dtype):
    """Every code of a format, as a tensor of that format (4096 x 16 for the 2-byte ones)."""
    n = 256**dtype.itemsize
    raw = np.arange(n, dtype=np.uint8 if n == 256 else np.uint16)
    return torch.from_numpy(raw).view(dtype).reshape(-1, 16)


def _x(n, seed=0):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 300
    return torch.cat([x, torch.tensor(SPECIAL)])


@pytest.mark.parametrize("dtype", list(FORMATS.values()))
def test_float_decode_widens_every_code_as_torch_does(dtype):
    codes = _all_codes(dtype)
    want = _bits(codes.float())
    for backend in ("cpu", "reference"):
        assert torch.equal(_bits(float_decode(codes, backend=backend)), want)
    assert torch.equal(_bits(float_decode(codes[:, ::3])), _bits(codes[:, ::3].float()))
    out = torch.empty(codes.shape)
    assert float_decode(codes, out=out) is out and torch.equal(_bits(out), want)
    with pytest.raises(QSyncError):
        float_decode(codes.float())


@pytest.mark.parametrize("dtype", list(FORMATS.values()))
@pytest.mark.parametrize("rows, n", [(1, 40), (2, 4096 * 3 + 5), (3, 70_001)])
def test_float_decode_sum_adds_the_rows_in_turn(dtype, rows, n):
    """Bit for bit the sum torch makes adding each row's widened values to zeros (NaN
    payloads aside: torch's are its own), the CPU kernel and the reference alike, NaNs
    included, over block and chunk edges; ``out`` is written, not added to."""
    x = torch.stack([_x(n - len(SPECIAL), seed=r) * 4 ** r for r in range(rows)]).to(dtype)
    want = torch.zeros(n)
    for row in x:
        want.add_(row.float())
    nan = torch.isnan(want)
    reference = float_decode_sum(x, backend="reference")
    assert torch.equal(torch.isnan(reference), nan)
    assert torch.equal(_bits(reference[~nan]), _bits(want[~nan]))
    assert torch.equal(_bits(float_decode_sum(x, backend="cpu")), _bits(reference))
    out = torch.full((n,), float("nan"))
    assert float_decode_sum(x, out=out) is out and torch.equal(_bits(out), _bits(reference))
    grid = x.reshape(rows, 1, n)  # rows of any shape, and non-contiguous input
    assert torch.equal(_bits(float_decode_sum(grid)), _bits(reference.reshape(1, n)))
    assert torch.equal(_bits(float_decode_sum(x.t().contiguous().t())), _bits(reference))
    payloads = torch.cat([x[:, :7], x], 1)  # rows read in place behind a header
    assert torch.equal(_bits(float_decode_sum(payloads[:, 7:], backend="cpu")), _bits(reference))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("scale", [0.5, 1 / 3, -2.0**-20])
def test_float_decode_sum_scales_the_sum_as_torch_does(backend, scale):
    """``(sum) * scale`` rounded once, as torch multiplies a float32 sum by a Python number."""
    x = torch.stack([_x(9000, seed=r) for r in range(3)]).to(torch.float8_e5m2)
    want = float_decode_sum(x, backend="reference") * scale
    got = float_decode_sum(x, scale=scale, backend=backend)
    assert torch.equal(_bits(got), _bits(want))


def test_float_decode_sum_of_no_rows_is_zero_and_bad_input_is_refused():
    for backend in ("cpu", "reference"):
        none = torch.empty(0, 3, dtype=torch.float16)
        assert float_decode_sum(none, backend=backend).tolist() == [0.0] * 3
    with pytest.raises(QSyncError, match="at least one dimension"):
        float_decode_sum(torch.tensor(1.0).to(torch.float16))
    with pytest.raises(QSyncError, match="float8_e5m2"):
        float_decode_sum(torch.zeros(2, 3))
    with pytest.raises(QSyncError, match="out must be a contiguous"):
        float_decode_sum(torch.zeros(2, 3, dtype=torch.float16), out=torch.zeros(2, 3))
    with pytest.raises(QSyncError, match="scale must be a finite number"):
        float_decode_sum(torch.zeros(2, 3, dtype=torch.float16), scale=float("inf"))


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("scale", [None, 1.0, 0.37, torch.tensor(2.5)])
@pytest.mark.parametrize("n", [500, cpu.floats.SPECIALIZE_MIN])  # generic and format-specialised
def test_float_quantize_is_scaled_encode_then_decode(name, scale, n):
    x = _x(n)
    want = float_encode(x if scale is None else x / torch.as_tensor(scale), name)
    for backend in ("cpu", "reference"):
        q = float_quantize(x, name, scale=scale, backend=backend)
        assert q.codes.dtype == FORMATS[name] and torch.equal(_bits(q.codes), _bits(want))
        assert torch.equal(_bits(q.values), _bits(float_decode(want)))  # NaNs included
        codes = torch.empty(x.shape, dtype=FORMATS[name])  # the codes alone, in one pass too
        assert float_encode(x, name, scale=scale, backend=backend, out=codes) is codes
        assert torch.equal(_bits(codes), _bits(want))


def test_float_quantize_reads_half_inputs_and_keeps_the_shape():
    x = _x(300).reshape(-1, 3).to(torch.bfloat16)
    q = float_quantize(x, "fp8_e5m2", scale=torch.tensor(4.0))
    assert q.codes.shape == q.values.shape == x.shape
    assert torch.equal(_bits(q.codes), _bits(float_encode(x.float() / 4.0, "fp8_e5m2")))


@pytest.mark.parametrize("fmt, dtype", [(floatfmt.FP8_E4M3, torch.float8_e4m3fn),
                                         (floatfmt.FP8_E5M2, torch.float8_e5m2)])
def test_plain_widen_gives_torchs_bits_for_every_fp8_code(fmt, dtype):
    """The plain function (the CUDA kernels compile the same source), NaNs made quiet."""
    codes = torch.arange(256, dtype=torch.uint8)
    want = _bits(codes.view(dtype).float()).tolist()
    got = [int(floatfmt.widen(c, fmt)) for c in range(256)]
    assert [np.int32(np.uint32(v)) for v in got] == want


@pytest.mark.parametrize("shape", [(40, 70), (6, 300)])  # scales per position / per row
@pytest.mark.parametrize("axis", [None, 0, 1])
@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e4m3", (4, 3)])
def test_dequantize_into_a_float_format(shape, axis, fmt):
    q = quantize_int8(torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 1e3,
                      axis=axis)
    want = float_round(dequantize_int8(q.codes, q.scale, axis=axis), fmt)
    for backend in ("cpu", "reference"):
        got = dequantize_int8(q.codes, q.scale, axis=axis, fmt=fmt, backend=backend)
        assert torch.equal(_bits(got), _bits(want))
    half = dequantize_int8(q.codes, q.scale, axis=axis, fmt=fmt, dtype=torch.float16)
    assert torch.equal(half, want.half())


def test_dequantize_into_fp16_equals_the_torch_round_trip():
    q = quantize_int8(torch.randn(8, 12, 128, 64, generator=torch.Generator().manual_seed(2)))
    want = (q.codes.float() * q.scale).half().float()
    assert torch.equal(dequantize_int8(q.codes, q.scale, fmt="fp16"), want)


_FF = floatfmt.build(njit)
_round, _round_wide = _FF.round_bits, _FF.round_wide


@njit(parallel=True)
def _wide_mismatches(bits, fmt):
    bad = 0
    for i in prange(bits.size):
        if _round_wide(bits[i], fmt) != _round(bits[i], fmt):
            bad += 1
    return bad


def test_round_wide_equals_round_bits():
    """Checked for all 2**32 inputs of bf16, tf32, (8, 1) and (8, 22) when written; here on
    every exponent with mantissas around the rounding ties, and random bits."""
    mant = np.array([0, 1, 0x7FFFFF, 0x400000, 0x3FFFFF, 0x8000, 0x7FFF, 0x18000, 0x1000,
                     0xFFF, 0x3000, 0x2FFF, 0x3001], dtype=np.uint32)  # fmt: skip
    grid = ((np.arange(256, dtype=np.uint32) << np.uint32(23))[:, None] | mant).reshape(-1)
    rand = np.random.default_rng(3).integers(0, 2**32, 1 << 18, dtype=np.uint64)
    bits = np.concatenate([grid, grid | np.uint32(0x80000000), rand.astype(np.uint32)])
    for fmt in (floatfmt.BF16, floatfmt.ieee_format(8, 10), floatfmt.ieee_format(8, 1)):
        assert floatfmt.is_wide(fmt)
        assert _wide_mismatches(bits, fmt) == 0, fmt
    for b in bits[:: bits.size // 500]:
        assert floatfmt.round_wide(b, floatfmt.BF16) == floatfmt.round_bits(b, floatfmt.BF16)
    assert not floatfmt.is_wide(floatfmt.FP16) and not floatfmt.is_wide(floatfmt.FP32)


@pytest.mark.parametrize("name", ["bf16", (8, 10)])
def test_specialised_wide_round_kernel_equals_the_generic_one(name):
    x = torch.cat([_x(cpu.floats.SPECIALIZE_MIN), torch.tensor(SPECIAL) * 1e-30])
    want = float_round(x, name, backend="reference")
    assert torch.equal(_bits(float_round(x, name)), _bits(want))
