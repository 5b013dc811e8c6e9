"""abs-max, INT8 quantize/dequantize (RNE and stochastic) and fused fake-quantize."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsync_lab.errors import QSyncError
from qsync_lab.kernels import (
    absmax,
    dequantize_int8,
    dequantize_int8_sum,
    fake_quantize_int8,
    quantize_int8,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _x(shape=(6, 5, 7), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


def _torch_absmax(x, axis):
    a = x.float().abs()
    if axis is None:
        return a.amax()
    return a.movedim(axis, 0).reshape(x.shape[axis], -1).amax(dim=1)


# ----------------------------------------------------------------------------- abs-max


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [None, 0, 1, 2, -1])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_absmax_matches_torch(dtype, axis, backend):
    x = _x(dtype=dtype)
    assert torch.equal(absmax(x, axis, backend=backend), _torch_absmax(x, axis))


def test_absmax_nan_propagates_empty_is_zero():
    x = torch.tensor([[1.0, float("nan")], [2.0, -3.0]])
    assert torch.isnan(absmax(x))
    per_row = absmax(x, 0)
    assert torch.isnan(per_row[0]) and per_row[1] == 3.0
    assert absmax(torch.tensor([1.0, -float("inf")])) == float("inf")
    assert absmax(torch.empty(0)) == 0
    assert absmax(torch.empty(3, 0), 0).tolist() == [0.0, 0.0, 0.0]


# ----------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_nearest_matches_torch_round(axis, dtype):
    x = _x(dtype=dtype)
    q = quantize_int8(x, axis=axis, backend="cpu")
    scale = _torch_absmax(x, axis) / 127
    shape = [1] * x.dim()
    if axis is not None:
        shape[axis] = -1
    want = torch.clamp(torch.round(x.float() / scale.reshape(shape)), -127, 127).to(torch.int8)
    assert torch.equal(q.codes, want)
    assert torch.equal(q.scale, scale)
    ref = quantize_int8(x, axis=axis, backend="reference")
    assert torch.equal(ref.codes, want)


def test_quantize_ties_round_half_to_even():
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])  # scale 1
    assert quantize_int8(x).codes.tolist() == [127, 0, 2, 2, 0, -2]


@pytest.mark.parametrize("axis", [None, 1])
def test_stochastic_cpu_matches_reference_and_is_reproducible(axis):
    x = _x()
    a = quantize_int8(x, axis=axis, rounding="stochastic", seed=7, backend="cpu")
    b = quantize_int8(x, axis=axis, rounding="stochastic", seed=7, backend="reference")
    assert torch.equal(a.codes, b.codes)
    again = quantize_int8(x, axis=axis, rounding="stochastic", seed=7)
    assert torch.equal(a.codes, again.codes)
    other = quantize_int8(x, axis=axis, rounding="stochastic", seed=8)
    assert not torch.equal(a.codes, other.codes)


def test_stochastic_is_unbiased_with_bounded_variance():
    x = torch.linspace(-1, 1, 257)  # scale = 1/127, fractional parts cover [0, 1)
    seeds = 400
    draws = torch.stack(
        [dequantize_int8(*quantize_int8(x, rounding="stochastic", seed=s)[:2]) for s in range(seeds)]
    )
    unit = float(x.abs().max()) / 127
    err = draws - x
    # each draw is floor or floor+1 step, so the mean error's std is <= unit/(2*sqrt(seeds))
    assert err.mean(0).abs().max() < 5 * unit / (2 * seeds**0.5)
    frac = (x / unit) - torch.floor(x / unit)
    bound = frac * (1 - frac) * unit**2  # Bernoulli variance, <= unit**2 / 4
    assert (err.var(0) <= bound * 1.5 + 1e-12).all()
    assert err.var(0).max() <= unit**2 / 4 * 1.2


def test_dequantize_matches_reference_and_dtype():
    x = _x()
    q = quantize_int8(x, axis=2)
    a = dequantize_int8(q.codes, q.scale, axis=2, backend="cpu")
    b = dequantize_int8(q.codes, q.scale, axis=2, backend="reference")
    assert torch.equal(a, b)
    assert torch.allclose(a, x, atol=float(q.scale.max()) / 2 + 1e-7)
    assert dequantize_int8(q.codes, q.scale, axis=2, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_all_zero_and_tiny_tensors_give_zero_codes_without_nan():
    for x in (torch.zeros(4, 3), torch.full((5,), 1e-45), torch.tensor([0.0, -0.0])):
        q = quantize_int8(x, rounding="stochastic")
        assert not q.codes.any() and float(q.scale) >= 0
        y = dequantize_int8(q.codes, q.scale)
        assert not torch.isnan(y).any()
        r = fake_quantize_int8(x)
        assert not torch.isnan(r.output).any() and np.isfinite(r.sse)
    q = quantize_int8(torch.zeros(3, 2), axis=1)
    assert q.scale.tolist() == [0.0, 0.0]


def test_huge_values_quantize_finitely():
    x = torch.tensor([3.4e38, -3.4e38, 1e30, 0.0])
    q = quantize_int8(x)
    assert q.codes.tolist()[:2] == [127, -127]
    assert torch.isfinite(dequantize_int8(q.codes, q.scale)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_inf_raise_one_line(bad):
    x = torch.tensor([1.0, bad])
    for fn in (quantize_int8, fake_quantize_int8):
        with pytest.raises(QSyncError, match="NaN or Inf") as err:
            fn(x)
        assert "\n" not in str(err.value)


def test_given_scale_and_empty():
    x = torch.tensor([0.5, -1.0, 4.0])
    assert quantize_int8(x, scale=torch.tensor(0.5)).codes.tolist() == [1, -2, 8]
    e = quantize_int8(torch.empty(0, 4), axis=1)
    assert e.codes.shape == (0, 4) and e.scale.tolist() == [0.0] * 4
    r = fake_quantize_int8(torch.empty(0))
    assert r.numel == 0 and r.sse == 0.0


@pytest.mark.parametrize(
    "call",
    [
        lambda: quantize_int8(torch.arange(3)),
        lambda: quantize_int8([1.0, 2.0]),
        lambda: quantize_int8(torch.zeros(3), axis=1),
        lambda: quantize_int8(torch.zeros(3), rounding="up"),
        lambda: quantize_int8(torch.zeros(3), seed=-1),
        lambda: quantize_int8(torch.zeros(3), backend="gpu"),
        lambda: quantize_int8(torch.zeros(2, 3), axis=1, scale=torch.ones(2)),
        lambda: quantize_int8(torch.zeros(3), scale=torch.tensor(-1.0)),
        lambda: dequantize_int8(torch.zeros(3), torch.tensor(1.0)),
    ],
)
def test_bad_input_raises_one_line(call):
    with pytest.raises(QSyncError) as err:
        call()
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- fake-quantize


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fake_quantize_matches_reference_and_stats(dtype, rounding):
    x = _x(dtype=dtype)
    a = fake_quantize_int8(x, axis=0, rounding=rounding, seed=3, backend="cpu")
    b = fake_quantize_int8(x, axis=0, rounding=rounding, seed=3, backend="reference")
    assert a.output.dtype == dtype
    assert torch.equal(a.output, b.output)
    assert a.numel == x.numel() and torch.equal(a.scale, b.scale)
    sse = float(((a.output.double() - x.double()) ** 2).sum())
    assert a.sse == pytest.approx(sse, rel=1e-12) and b.sse == pytest.approx(sse, rel=1e-12)
    q = quantize_int8(x, axis=0, rounding=rounding, seed=3)
    want = dequantize_int8(q.codes, q.scale, axis=0).to(dtype)
    assert torch.equal(a.output, want)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    scale_exp=st.integers(-40, 38),
    transpose=st.booleans(),
    per_channel=st.booleans(),
    seed=st.integers(0, 2**63 - 1),
)
def test_property_cpu_equals_reference(shape, dtype, scale_exp, transpose, per_channel, seed):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 10.0**scale_exp).to(dtype)
    x = torch.nan_to_num(x, posinf=1.0, neginf=-1.0)
    if transpose and x.dim() >= 2:
        x = x.transpose(0, -1)
    axis = 0 if per_channel else None
    for rounding in ("nearest", "stochastic"):
        a = quantize_int8(x, axis=axis, rounding=rounding, seed=seed, backend="cpu")
        b = quantize_int8(x, axis=axis, rounding=rounding, seed=seed, backend="reference")
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
        assert a.codes.shape == x.shape
    fa = fake_quantize_int8(x, axis=axis, backend="cpu")
    fb = fake_quantize_int8(x, axis=axis, backend="reference")
    assert torch.equal(fa.output, fb.output)
    assert not torch.isnan(fa.output).any()


# ------------------------------------------------------------------- sum of scaled rows


def _decode_then_add(codes, scales, divisor):
    """What adding each row's ``dequantize_int8`` to zeros, then dividing, gives (torch)."""
    total = torch.zeros(codes.shape[1:])
    for row, scale in zip(codes, scales):
        total.add_(dequantize_int8(row, torch.tensor(scale)))
    return total.div_(divisor)


@pytest.mark.parametrize("rows, n", [(1, 40), (2, 4096 * 3 + 5), (4, 70_001)])
@pytest.mark.parametrize("divisor", [1, 3])
def test_dequantize_int8_sum_adds_the_scaled_rows_in_turn(rows, n, divisor):
    """Bit for bit the sum torch makes adding each row's dequantized values to zeros and
    dividing it, on the CPU kernel and the reference, over block and chunk edges (scales
    of very different sizes, so that the order of the additions shows); ``out`` is written,
    not added to."""
    g = torch.Generator().manual_seed(rows * n)
    codes = torch.randint(-127, 128, (rows, n), generator=g, dtype=torch.int8)
    scales = [0.37 * 1000.0 ** -r for r in range(rows)]
    want = _decode_then_add(codes, scales, divisor)
    for backend in ("cpu", "reference"):
        assert torch.equal(dequantize_int8_sum(codes, scales, divisor=divisor,
                                               backend=backend), want)
    out = torch.full((n,), float("nan"))
    assert dequantize_int8_sum(codes, torch.tensor(scales), divisor=divisor, out=out) is out
    assert torch.equal(out, want)


def test_dequantize_int8_sum_reads_rows_in_place_at_any_stride():
    """Rows behind a header (gathered packed payloads), rows of any shape, and
    non-contiguous rows (copied first) all give the sum of the rows as given."""
    payloads = torch.randint(-127, 128, (3, 8 + 5000), dtype=torch.int8)
    codes = payloads[:, 8:]  # each row contiguous, 5008 apart
    scales = [0.5, 2.0, 0.001]
    want = _decode_then_add(codes.contiguous(), scales, 3)
    for backend in ("cpu", "reference"):
        assert torch.equal(dequantize_int8_sum(codes, scales, divisor=3, backend=backend), want)
    grid = codes.reshape(3, 50, 100)
    assert torch.equal(dequantize_int8_sum(grid, scales, divisor=3), want.reshape(50, 100))
    columns = codes.contiguous().reshape(3, 100, 50).transpose(1, 2)  # rows not contiguous
    assert torch.equal(dequantize_int8_sum(columns, scales, divisor=3),
                       want.reshape(100, 50).t())
    one = dequantize_int8_sum(codes[1:2], scales[1:2])
    assert torch.equal(one, dequantize_int8(codes[1], torch.tensor(2.0)))


def test_dequantize_int8_sum_of_no_rows_is_zero_and_bad_input_is_refused():
    for backend in ("cpu", "reference"):
        none = torch.empty(0, 3, dtype=torch.int8)
        assert dequantize_int8_sum(none, [], backend=backend).tolist() == [0.0] * 3
    codes = torch.ones(2, 3, dtype=torch.int8)
    for call, match in [
        (lambda: dequantize_int8_sum(codes.float(), [1, 1]), "int8"),
        (lambda: dequantize_int8_sum(torch.tensor(1, dtype=torch.int8), []), "one dimension"),
        (lambda: dequantize_int8_sum(codes, [1.0]), "one scale per row"),
        (lambda: dequantize_int8_sum(codes, [1.0, float("nan")]), "finite and >= 0"),
        (lambda: dequantize_int8_sum(codes, [1.0, -1.0]), "finite and >= 0"),
        (lambda: dequantize_int8_sum(codes, [1, 1], divisor=0), "positive finite"),
        (lambda: dequantize_int8_sum(codes, [1, 1], out=torch.zeros(2, 3)), "contiguous"),
    ]:
        with pytest.raises(QSyncError, match=match):
            call()
