"""Gradient-compression primitives: APS, Global-QSGD, CGX, QSGD."""

import math

import numpy as np
import pytest
import torch

from qsync_lab.errors import QSyncError
from qsync_lab.kernels import (
    APS_ZERO_EXPONENT,
    aps_dequantize,
    aps_exponent,
    aps_quantize,
    aps_shift,
    cgx_decode,
    cgx_decode_mean,
    cgx_encode,
    float_round,
    global_qsgd_decode,
    global_qsgd_encode,
    l2norm,
    qsgd_decode,
    qsgd_encode,
)
from qsync_lab.kernels import reference


def _g(n=1000, seed=0, scale=1.0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


# ----------------------------------------------------------------------------- APS


def test_aps_exponent_shift_and_exact_scaling():
    x = torch.tensor([0.3, -1.5])
    assert aps_exponent(x, 4) == 3  # max |4x| = 6 -> 2**3
    assert aps_exponent(torch.tensor([2.0]), 2) == 2  # exactly a power of two
    shift = aps_shift(3, (5, 2))
    assert shift == 15 - 3
    y = aps_quantize(x, shift, (5, 2))
    assert torch.equal(y, float_round(x * 2.0**shift, (5, 2)))
    assert (y.abs() * 4 <= 2.0**15).all()  # the n-way sum stays below 2**bias: no overflow
    assert torch.equal(aps_dequantize(y, shift), y / 2.0**shift)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_aps_round_trip_backends_agree(backend):
    g = _g(scale=1e-6)
    e = aps_exponent(g, 8, backend=backend)
    shift = aps_shift(e, "fp8_e5m2")
    y = aps_quantize(g, shift, "fp8_e5m2", backend=backend)
    assert torch.equal(y, aps_quantize(g, shift, "fp8_e5m2", backend="cpu"))
    back = aps_dequantize(y, shift, backend=backend)
    assert torch.allclose(back, g, rtol=0.13, atol=0)  # e5m2 relative step 2**-2 / 2


def test_aps_zero_tensor_gives_no_nan():
    z = torch.zeros(10)
    assert aps_exponent(z, 4) == APS_ZERO_EXPONENT
    shift = aps_shift(APS_ZERO_EXPONENT, (4, 3))
    y = aps_quantize(z, shift, (4, 3))
    assert torch.equal(y, z) and torch.equal(aps_dequantize(y, shift), z)


def test_aps_nan_raises():
    with pytest.raises(QSyncError, match="NaN or Inf"):
        aps_exponent(torch.tensor([float("nan")]), 2)


# ----------------------------------------------------------------------------- Global-QSGD


@pytest.mark.parametrize("dithering", ["standard", "exponential"])
def test_global_qsgd_cpu_matches_reference(dithering):
    g = _g()
    m = float(g.abs().max())
    a = global_qsgd_encode(g, m, 4, dithering=dithering, seed=5, backend="cpu")
    b = global_qsgd_encode(g, m, 4, dithering=dithering, seed=5, backend="reference")
    assert torch.equal(a, b)
    da = global_qsgd_decode(a, m, 4, dithering=dithering, backend="cpu")
    db = global_qsgd_decode(b, m, 4, dithering=dithering, backend="reference")
    assert torch.equal(da, db)


def test_global_qsgd_headroom_sums_without_overflow():
    n = 8
    workers = [_g(500, seed=s) for s in range(n)]
    m = max(float(w.abs().max()) for w in workers)
    codes = [global_qsgd_encode(w, m, n, seed=s) for s, w in enumerate(workers)]
    levels = 127 // n
    assert all(c.abs().max() <= levels for c in codes)
    total = torch.stack([c.to(torch.int32) for c in codes]).sum(0)
    summed_int8 = torch.stack(codes).sum(0, dtype=torch.int8)
    assert torch.equal(total, summed_int8.to(torch.int32))  # no int8 overflow
    mean = global_qsgd_decode(summed_int8, m, n) / n
    assert torch.allclose(mean, torch.stack(workers).mean(0), atol=n * m / levels / n + 1e-6)


@pytest.mark.parametrize("dithering", ["standard", "exponential"])
def test_global_qsgd_unbiased_with_bounded_variance(dithering):
    x = _g(200, seed=1)
    m, n, draws = float(x.abs().max()), 4, 400
    dec = torch.stack(
        [
            global_qsgd_decode(
                global_qsgd_encode(x, m, n, dithering=dithering, seed=s), m, n,
                dithering=dithering,
            )
            for s in range(draws)
        ]
    ).double()
    err = dec - x.double()
    if dithering == "standard":
        unit = m / (127 // n)
        per_elem_bound = unit**2 / 4  # Bernoulli rounding between neighbouring levels
    else:
        per_elem_bound = (x.double() ** 2) / 8  # (2a - r)(r - a) <= r**2 / 8 for r in [a, 2a]
        per_elem_bound = per_elem_bound + (m * 2.0**-126) ** 2
    std_mean = torch.sqrt(torch.as_tensor(per_elem_bound) / draws)
    assert (err.mean(0).abs() <= 5 * std_mean + 1e-9).all()
    assert (err.var(0) <= 1.5 * per_elem_bound + 1e-12).all()


def test_global_qsgd_exponential_codes_are_powers_of_two():
    x = torch.tensor([1.0, -0.5, 0.0, 0.3, -1e-30])
    codes = global_qsgd_encode(x, 1.0, 2, dithering="exponential")
    vals = global_qsgd_decode(codes, 1.0, 2, dithering="exponential")
    assert vals[:3].tolist() == [1.0, -0.5, 0.0]
    nz = vals[vals != 0].abs()
    assert torch.equal(nz, torch.exp2(torch.round(torch.log2(nz))))


def test_global_qsgd_bad_inputs():
    x = torch.tensor([1.0, -2.0])
    with pytest.raises(QSyncError, match="below this tensor's max"):
        global_qsgd_encode(x, 1.0, 2)
    with pytest.raises(QSyncError, match="no int8 level"):
        global_qsgd_encode(x, 2.0, 200)
    with pytest.raises(QSyncError, match="dithering"):
        global_qsgd_encode(x, 2.0, 2, dithering="binary")
    with pytest.raises(QSyncError, match="NaN or Inf"):
        global_qsgd_encode(torch.tensor([float("nan")]), 1.0, 2)
    zero = global_qsgd_encode(torch.zeros(4), 0.0, 2)
    assert not zero.any()


# ----------------------------------------------------------------------------- CGX


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack_round_trip(bits):
    codes = np.random.default_rng(bits).integers(0, 1 << bits, 37)
    payload = reference.pack_bits(codes, bits)
    assert payload.size == math.ceil(37 / 8) * bits
    np.testing.assert_array_equal(reference.unpack_bits(payload, bits, 37), codes)


@pytest.mark.parametrize("bits", [1, 3, 4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_cgx_cpu_matches_reference(bits, rounding):
    x = _g(1003).reshape(17, 59)
    a = cgx_encode(x, bits, 64, rounding=rounding, seed=2, backend="cpu")
    b = cgx_encode(x, bits, 64, rounding=rounding, seed=2, backend="reference")
    assert torch.equal(a.payload, b.payload) and torch.equal(a.meta, b.meta)
    da, db = cgx_decode(a, backend="cpu"), cgx_decode(b, backend="reference")
    assert torch.equal(da, db) and da.shape == x.shape
    unit = a.meta[:, 1].repeat_interleave(64)[: x.numel()].reshape(x.shape)
    assert ((da - x).abs() <= unit * (1.0 if rounding == "stochastic" else 0.5) + 1e-6).all()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("bits", [1, 3, 4, 8])
@pytest.mark.parametrize("bucket", [50, 64])  # decoded afterwards, and in the encode's pass
def test_cgx_error_out_is_x_minus_the_decoded_values(backend, bits, bucket):
    """Bit for bit ``x`` minus its float32 values ``min + unit·q``, fp16 input and a partial
    last group included; ``error_out`` is overwritten."""
    for x in (_g(1003).reshape(17, 59), _g(1003, seed=3).to(torch.float16)):
        error = torch.full(x.shape, float("nan"))
        packed = cgx_encode(x, bits, bucket, seed=2, backend=backend, error_out=error)
        values = cgx_decode(packed._replace(dtype=torch.float32), backend="reference")
        assert torch.equal(error, x.float() - values)
        same = cgx_encode(x, bits, bucket, seed=2, backend=backend)
        assert torch.equal(packed.payload, same.payload)  # the codes do not change
    with pytest.raises(QSyncError, match="error_out must be a contiguous"):
        cgx_encode(x, bits, bucket, error_out=torch.empty(3))


@pytest.mark.parametrize("bucket", [50, 64])  # code by code, and group by group in one read
def test_cgx_cpu_matches_reference_on_signed_zeros_and_constant_groups(bucket):
    x = _g(640, seed=5)
    x[:bucket] = -0.0
    x[bucket:2 * bucket] = 3.0
    x[2 * bucket + 1] = 0.0
    x[2 * bucket + 2] = -1e30
    a = cgx_encode(x, 4, bucket, seed=1, backend="cpu")
    b = cgx_encode(x, 4, bucket, seed=1, backend="reference")
    assert torch.equal(a.payload, b.payload) and torch.equal(a.meta, b.meta)
    assert torch.equal(cgx_decode(a), cgx_decode(b, backend="reference"))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_cgx_non_finite_marks_its_group_only_when_asked(backend, bad):
    x = _g(256, seed=6)
    x[70] = bad
    packed = cgx_encode(x, 4, 64, check_finite=False, backend=backend)
    finite = torch.isfinite(packed.meta).all(dim=1)
    assert finite.tolist() == [True, False, True, True]
    with pytest.raises(QSyncError, match="NaN or Inf"):
        cgx_encode(x, 4, 64, backend=backend)


@pytest.mark.parametrize("bits", [3, 8])  # unpacked, and read from the payload itself
@pytest.mark.parametrize("bucket", [24, 50])
def test_cgx_decode_accumulates_into_out(bucket, bits):
    parts = [cgx_encode(_g(203, seed=s), bits, bucket, seed=s) for s in range(3)]
    total = torch.full((203,), 0.25)
    for p in parts:
        assert cgx_decode(p, out=total) is total
    want = 0.25 + sum(cgx_decode(p, backend="reference").double() for p in parts)
    torch.testing.assert_close(total.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("bucket,ranks", [(24, 3), (50, 2), (512, 4), (8, 1)])
def test_cgx_decode_mean_sums_in_rank_order_then_divides(backend, bits, bucket, ranks):
    parts = [cgx_encode(_g(1203, seed=s), bits, bucket, seed=s) for s in range(ranks)]
    exact = torch.zeros(1203)  # the same float32 arithmetic, one decode per payload
    for p in parts:
        cgx_decode(p, out=exact, backend="reference")
    exact.div_(ranks)
    out = torch.full((1203,), float("nan"))
    assert cgx_decode_mean(parts, out=out, backend=backend) is out
    assert torch.equal(out, exact)
    mean = sum(cgx_decode(p, backend="reference").double() for p in parts) / ranks
    torch.testing.assert_close(cgx_decode_mean(parts, backend=backend).double(), mean,
                               rtol=0, atol=1e-6)


def test_cgx_decode_mean_refuses_mixed_payloads_and_bad_out():
    a, b = cgx_encode(_g(64), 4, 32), cgx_encode(_g(64), 3, 32)
    with pytest.raises(QSyncError, match="same shape, bits and bucket size"):
        cgx_decode_mean([a, b])
    with pytest.raises(QSyncError, match="non-empty list"):
        cgx_decode_mean([])
    with pytest.raises(QSyncError, match="contiguous torch.float32 tensor of shape"):
        cgx_decode_mean([a], out=torch.zeros(63))


def test_cgx_stochastic_unbiased_and_bounded():
    x = _g(256, seed=3)
    draws = torch.stack([cgx_decode(cgx_encode(x, 2, 32, seed=s)) for s in range(300)]).double()
    meta = cgx_encode(x, 2, 32).meta
    unit = meta[:, 1].double().repeat_interleave(32)
    err = draws - x.double()
    assert (err.mean(0).abs() <= 5 * unit / (2 * 300**0.5) + 1e-7).all()
    assert (err.var(0) <= 1.5 * unit**2 / 4 + 1e-12).all()


def test_cgx_constant_groups_dtypes_and_errors():
    p = cgx_encode(torch.full((10,), 2.5, dtype=torch.bfloat16), 4, 4)
    out = cgx_decode(p)
    assert out.dtype == torch.bfloat16 and (out == 2.5).all()
    assert cgx_decode(cgx_encode(torch.empty(0), 4)).shape == (0,)
    with pytest.raises(QSyncError, match="bits"):
        cgx_encode(torch.zeros(4), 9)
    with pytest.raises(QSyncError, match="bucket_size"):
        cgx_encode(torch.zeros(4), 4, 0)
    with pytest.raises(QSyncError, match="NaN or Inf"):
        cgx_encode(torch.tensor([float("inf")]), 4)


# ----------------------------------------------------------------------------- QSGD


def test_l2norm_backends_agree():
    x = _g(5000)
    want = float(torch.linalg.vector_norm(x.double()))
    assert l2norm(x, backend="cpu") == pytest.approx(want, rel=1e-12)
    assert l2norm(x, backend="reference") == pytest.approx(want, rel=1e-12)
    assert l2norm(torch.empty(0)) == 0.0


def test_qsgd_cpu_matches_reference_and_variance_bound():
    x = _g(300, seed=4)
    s = 4
    a = qsgd_encode(x, s, seed=1, backend="cpu")
    b = qsgd_encode(x, s, seed=1, backend="reference", norm=a.norm)
    assert torch.equal(a.codes, b.codes) and a.codes.abs().max() <= s
    draws = torch.stack(
        [qsgd_decode(qsgd_encode(x, s, seed=k).codes, a.norm, s) for k in range(300)]
    ).double()
    err = draws - x.double()
    d, norm2 = x.numel(), float((x.double() ** 2).sum())
    bound = min(d / s**2, math.sqrt(d) / s) * norm2
    assert float((err**2).sum(1).mean()) <= bound
    unit = a.norm / s
    assert (err.mean(0).abs() <= 5 * unit / (2 * 300**0.5)).all()


def test_qsgd_zero_and_nan():
    z = qsgd_encode(torch.zeros(5), 8)
    assert z.norm == 0.0 and not z.codes.any()
    assert not torch.isnan(qsgd_decode(z.codes, z.norm, 8)).any()
    with pytest.raises(QSyncError, match="NaN or Inf"):
        qsgd_encode(torch.tensor([1.0, float("nan")]), 8)
    with pytest.raises(QSyncError, match="levels"):
        qsgd_encode(torch.ones(3), 0)


@pytest.mark.parametrize("special", [float("inf"), float("-inf"), float("nan"), -float("nan"),
                                     3.4028234663852886e38,
                                     -3.4028234663852886e38])
def test_cgx_marks_exactly_the_groups_holding_nan_or_inf(special):
    """The finite check read from each group's min/max keys: only the group holding +-Inf or
    a NaN of either sign gets a non-finite meta, float32's largest values stay finite, on
    the CPU kernel as in the reference; the default check raises for a non-finite value
    only."""
    x = _g(64 * 5)
    x[2 * 64 + 17] = special
    finite = bool(np.isfinite(np.float32(special)))
    for backend in ("cpu", "reference"):
        meta = cgx_encode(x, 4, 64, check_finite=False, backend=backend).meta
        marked = (~torch.isfinite(meta).all(1)).tolist()
        assert marked == [False, False, not finite, False, False], backend
        if finite:
            cgx_encode(x, 4, 64, backend=backend)
        else:
            with pytest.raises(QSyncError, match="NaN or Inf"):
                cgx_encode(x, 4, 64, backend=backend)
