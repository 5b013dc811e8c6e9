"""CPU kernel loop shapes and fast paths against the reference.

Short rows (per channel along the last axes: period vectors), long rows, the fallbacks for
very long periods, chunk edges; the ``*_narrow`` float-format twins; stochastic rounding's
hash in 32-bit lanes; the shared exponential-dithering encoder; the disk cache.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from numba import njit, prange

from qsync_lab.errors import QSyncError
from qsync_lab.kernels import (
    absmax,
    cpu,
    dequantize_int8,
    fake_quantize_int8,
    float_round,
    floatfmt,
    quantize_int8,
    reference,
    rng,
)

# (shape, axis): which loop shape each one takes is in the comment
SHAPES = [
    ((300, 1000), -1),  # inner 1: the scales are the period vector (tiled x2)
    ((2000, 3), 1),  # inner 1, period 3 tiled to 1026; chunk edges fall inside periods
    ((50, 9, 40), 1),  # inner 40: repeated scales
    ((64, 3, 255), 1),  # inner 255, just under VEC_INNER
    ((40, 7, 300), 1),  # inner 300: long rows, one scale per segment
    ((33, 257, 1), 1),  # trailing size-1 dimension
    ((1, 70001), 1),  # a single row: nch = n
    ((2, 70000, 20), 1),  # period 1.4M > VEC_PERIOD_MAX: long-row fallback
    ((5, 300000), -1),  # abs-max partials over their cap: long-row abs-max
    ((123457,), None),  # per tensor
]


def _x(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("shape,axis", SHAPES)
def test_int8_paths_match_reference(shape, axis):
    x = _x(shape)
    assert torch.equal(absmax(x, axis), absmax(x, axis, backend="reference"))
    for rounding in ("nearest", "stochastic"):
        a = quantize_int8(x, axis=axis, rounding=rounding, seed=11)
        b = quantize_int8(x, axis=axis, rounding=rounding, seed=11, backend="reference")
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
        fa = fake_quantize_int8(x, axis=axis, rounding=rounding, seed=11)
        fb = fake_quantize_int8(x, axis=axis, rounding=rounding, seed=11, backend="reference")
        assert torch.equal(fa.output, fb.output)
        assert fa.sse == pytest.approx(fb.sse, rel=1e-12)
    d = dequantize_int8(a.codes, a.scale, axis=axis)
    assert torch.equal(d, dequantize_int8(a.codes, a.scale, axis=axis, backend="reference"))


@pytest.mark.parametrize("shape,axis", [((300, 1000), -1), ((50, 9, 40), 1), ((40, 7, 300), 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_short_and_long_rows(shape, axis, dtype):
    x = _x(shape, dtype)
    assert torch.equal(absmax(x, axis), absmax(x, axis, backend="reference"))
    a = quantize_int8(x, axis=axis)
    assert torch.equal(a.codes, quantize_int8(x, axis=axis, backend="reference").codes)
    fa = fake_quantize_int8(x, axis=axis, rounding="stochastic", seed=2)
    fb = fake_quantize_int8(x, axis=axis, rounding="stochastic", seed=2, backend="reference")
    assert fa.output.dtype == dtype and torch.equal(fa.output, fb.output)


@pytest.mark.parametrize("shape,axis", [((300, 1000), -1), ((50, 9, 40), 1), ((40, 7, 300), 1)])
def test_given_scales_with_zero_channels(shape, axis):
    x = _x(shape)
    scale = absmax(x, axis) / 127
    scale[::3] = 0  # a zero scale divides by 1 and gives codes of x itself, clamped
    for rounding in ("nearest", "stochastic"):
        a = quantize_int8(x, axis=axis, scale=scale, rounding=rounding, seed=5)
        b = quantize_int8(x, axis=axis, scale=scale, rounding=rounding, seed=5,
                          backend="reference")
        assert torch.equal(a.codes, b.codes)
    d = dequantize_int8(a.codes, scale, axis=axis)
    assert torch.equal(d, dequantize_int8(a.codes, scale, axis=axis, backend="reference"))


@pytest.mark.parametrize("shape,axis", [((300, 1000), -1), ((50, 9, 40), 1)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_short_rows_find_nan_in_the_quantize_pass(shape, axis, bad):
    x = _x(shape).reshape(-1)
    x[12345] = bad
    with pytest.raises(QSyncError, match="NaN or Inf"):
        quantize_int8(x.reshape(shape), axis=axis, scale=torch.full((shape[axis],), 0.1))


def test_short_row_outputs_go_to_out():
    x = _x((300, 1000))
    out = torch.empty(x.shape, dtype=torch.int8)
    q = quantize_int8(x, axis=-1, out=out)
    assert q.codes is out and torch.equal(out, quantize_int8(x, axis=-1).codes)
    y = torch.empty(x.shape)
    assert dequantize_int8(out, q.scale, axis=-1, out=y) is y
    assert torch.equal(y, dequantize_int8(out, q.scale, axis=-1, backend="reference"))


def test_period_vector():
    s = np.array([1.0, 2.0, 3.0], np.float32)
    v = cpu.layout._period_vector(s, 2, 3)
    assert v.size % 6 == 0 and v.size >= cpu.layout.VEC_MIN
    assert v[:7].tolist() == [1, 1, 2, 2, 3, 3, 1]
    assert cpu.layout._period_vector(s, cpu.layout.VEC_INNER, 3) is None
    assert cpu.layout._period_vector(s[:1], 1, 1) is None


# ----------------------------------------------------------------------------- rng


def test_rng_bits32_matches_rng_bits():
    idx = [0, 1, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**40 + 3, 2**63 - 1]
    idx += np.random.default_rng(3).integers(0, 2**63 - 1, 300).tolist()
    for seed in (0, 1, 2**63 - 1):
        key = rng.rng_key(seed)
        want = reference.rng_bits(key, np.array(idx, dtype=np.int64)).tolist()
        assert [int(cpu.scalar.rng_bits32(key, i)) for i in idx] == want


def test_runs_split_at_multiples_of_2_32_and_keep_the_global_index():
    # a run never crosses a multiple of 2**32, so stochastic rounding can hash its index
    # as a per-element low word and a per-run high word
    assert cpu.layout._period_stop(2**32 - 5, 2**32 + 100, 1024) == ((2**32 - 5) % 1024, 2**32)
    assert cpu.layout._segment(2**32 - 5, 2**33, 2**32, 3)[1] == 2**32
    assert cpu.layout._segment(2**32, 2**33, 2**40, 3)[1] == 2**33
    x = _x((500,)).numpy()
    key = rng.rng_key(6)
    for j0 in (2**32 - 500, 2**32, 2**33 + 17):
        out = np.zeros(500, np.int8)
        cpu.int8._q_run(x, x.view(np.int32), out, np.float32(0.05), np.float32(-127),
                        np.float32(127), True, key, j0)
        u = (reference.rng_bits(key, np.arange(j0, j0 + 500)) >> 8).astype(np.float32)
        v = (x / np.float32(0.05)).astype(np.float32)
        f = np.floor(v)
        want = np.clip(f + (u * np.float32(2.0**-24) < (v - f)), -127, 127).astype(np.int8)
        np.testing.assert_array_equal(out, want)


def test_cgx_pair_stream_runs_split_at_multiples_of_2_33():
    # CGX hashes pairs (16 random bits of rng_bits(key, j // 2) each), so a group's loop is
    # split where j // 2 crosses a multiple of 2**32 (its high word); odd group sizes end
    # on a lone element; two codes a byte for 4 bits
    x = _x((501,)).numpy()
    key = rng.rng_key(6)
    lo, inv = np.float32(x.min()), np.float32(2.5)
    for j0 in (0, 2**33 - 200, 2**33, 2**34 + 2**33 - 2):
        j = np.arange(j0, j0 + x.size, dtype=np.int64)
        h = reference.rng_bits(key, j >> 1) >> (16 * (j & 1))
        u = (h & 0xFFFF).astype(np.float32) * np.float32(2.0**-16)
        want = np.clip(np.floor((x - lo) * inv + u), 0, 15).astype(np.uint8)
        codes = np.zeros(x.size, np.uint8)
        cpu.cgx._cgx_group_codes(x, lo, inv, 15, True, key, j0, codes, False)
        np.testing.assert_array_equal(codes, want)
        packed = np.zeros((x.size + 1) // 2, np.uint8)
        cpu.cgx._cgx_group_codes(x, lo, inv, 15, True, key, j0, packed, True)
        np.testing.assert_array_equal(packed & 15, want[0::2])
        np.testing.assert_array_equal(packed[:-1] >> 4, want[1::2])


# ----------------------------------------------------------------------------- float formats

NARROW = [floatfmt.FP16, floatfmt.FP8_E4M3, floatfmt.FP8_E5M2] + [
    floatfmt.ieee_format(e, m) for e in range(2, 8) for m in (1, 2, 3, 5, 10, 22)
]


def _probe_bits():
    """Every exponent with mantissas at and around each possible rounding tie, both signs,
    the NaN/Inf patterns, and random bits."""
    mant = {0, 1, 0x7FFFFF, 0x400000, 0x3FFFFF}
    for k in range(23):
        mant.update({(1 << k) - 1, 1 << k, (1 << k) + 1, 3 << k, (3 << k) - 1, (3 << k) + 1})
    mant = np.array(sorted(m & 0x7FFFFF for m in mant), dtype=np.uint32)
    exps = np.arange(256, dtype=np.uint32) << np.uint32(23)
    grid = (exps[:, None] | mant[None, :]).reshape(-1)
    rand = np.random.default_rng(9).integers(0, 2**32, 1 << 20, dtype=np.uint64)
    bits = np.concatenate([grid, grid | np.uint32(0x80000000), rand.astype(np.uint32)])
    return bits.astype(np.uint32)


_FF = floatfmt.build(njit)
_encode, _encode_narrow = _FF.encode, _FF.encode_narrow
_round, _round_narrow = _FF.round_bits, _FF.round_narrow


@njit(parallel=True)
def _mismatches(bits, fmt):
    bad = 0
    for i in prange(bits.size):
        b = bits[i]
        if _encode(b, fmt) != _encode_narrow(b, fmt):
            bad += 1
        if _round(b, fmt) != _round_narrow(b, fmt):
            bad += 1
    return bad


def test_narrow_twins_equal_generic_functions():
    """Checked for all 2**32 inputs of fp16, both fp8 and ten CPD formats when written; here
    on tie-heavy and random bit patterns for 39 formats."""
    bits = _probe_bits()
    for fmt in NARROW:
        assert floatfmt.is_narrow(fmt)
        assert _mismatches(bits, fmt) == 0, fmt
    assert not floatfmt.is_narrow(floatfmt.BF16)  # E = 8
    assert not floatfmt.is_narrow(floatfmt.ieee_format(4, 0))  # M = 0: ties by exponent parity
    sample = bits[:: max(1, bits.size // 3000)]
    for fmt in (floatfmt.FP16, floatfmt.FP8_E4M3, floatfmt.ieee_format(3, 2)):
        for b in sample:
            assert floatfmt.encode_narrow(b, fmt) == floatfmt.encode(b, fmt)
            assert floatfmt.round_narrow(b, fmt) == floatfmt.round_bits(b, fmt)


@pytest.mark.parametrize("fmt", [(4, 3), (5, 2), (2, 1), (7, 22), (3, 0), (8, 7)])
def test_specialised_round_and_aps_match_reference(fmt, monkeypatch):
    monkeypatch.setattr(cpu.floats, "SPECIALIZE_MIN", 0)
    x = torch.from_numpy(_probe_bits()[::7].view(np.float32))
    spec = floatfmt.ieee_format(*fmt)
    got = float_round(x, fmt).numpy().view(np.uint32)
    np.testing.assert_array_equal(got, reference.round_to_format(x.numpy(), spec).view(np.uint32))
    from qsync_lab.kernels import aps_quantize

    got = aps_quantize(x, 5, fmt).numpy().view(np.uint32)
    want = reference.round_scaled(x.numpy(), *reference.pow2_factors(5), spec).view(np.uint32)
    np.testing.assert_array_equal(got, want)


def test_ieee_overflow_tie_of_formats_without_mantissa():
    # 1.5 * 2**emax is max + half an ulp: IEEE rounds it to Inf (its "even" neighbour would
    # be max, whose exponent field is even); 2**emax itself and just below stay finite
    x = torch.tensor([12.0, 11.999999, 8.0, -12.0, 3.0, 0.1875])
    want = [float("inf"), 8.0, 8.0, -float("inf"), 2.0, 0.25]  # 3 = 1.5 * 2: the even field
    for backend in ("cpu", "reference"):
        assert float_round(x, (3, 0), backend=backend).tolist() == want


def test_exp_dither_code_scalar_matches_reference():
    x = np.concatenate([_x((500,)).numpy(), np.float32([0.0, -0.0, 1e-45, -3.0, 1e-30])])
    m = np.float32(np.abs(x).max())
    key = rng.rng_key(4)
    want = reference.exp_dither_encode(x, m, seed=4)
    got = [floatfmt.exp_dither_code(v, m, m, rng.rng_bits(key, j)) for j, v in enumerate(x)]
    assert got == want.tolist()


# ----------------------------------------------------------------------------- disk cache


def test_disk_cache_key_includes_the_inlined_modules():
    """A cached kernel inlines floatfmt, rng and the helpers of the other CPU kernel
    modules: editing any of them must miss the cache."""
    disp = cpu.int8._quantize
    cache = getattr(disp, "_cache", None)
    if type(cache).__name__ != "FunctionCache":
        pytest.skip("no disk cache in this install")
    key = cache._index_key((), disp.targetctx.codegen())
    jit = cpu.jit
    assert key[-1] == jit._DEPS_DIGEST == jit._sources_digest(*jit._DEPENDENCIES)
    names = {os.path.basename(path) for path in jit._DEPENDENCIES}
    assert {"floatfmt.py", "rng.py", "layout.py", "scalar.py", "int8.py"} <= names


def test_jit_falls_back_without_a_cache_location():
    ns = {}
    exec("def f(a):\n    return a + 1\n", ns)  # no source file: Numba cannot cache it
    f = cpu.jit._jit()(ns["f"])
    assert f(41) == 42


_FACTORY_KERNEL_RUN = """
import numpy as np
from qsync_lab.kernels import cpu, floatfmt
kernel = cpu.int8._dequantize_for(floatfmt.FP16)  # closes over another jitted function
q = np.arange(-64, 64, dtype=np.int8)
out = np.empty(q.size, dtype=np.uint32)
cpu.dequantize(q, np.ones(1, np.float32), q.size, 1, out, fmt=floatfmt.FP16)
print(len(kernel.stats.cache_hits), len(kernel.stats.cache_misses))
"""


def test_a_factory_kernel_is_loaded_from_the_disk_cache_in_a_later_process(tmp_path):
    """Its closure holds a jitted function, which pickles with a per-process id: keyed by
    that, the kernel was compiled again in every process (seconds each)."""
    if type(getattr(cpu.int8._quantize, "_cache", None)).__name__ != "FunctionCache":
        pytest.skip("no disk cache in this install")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}

    def hits_and_misses():
        done = subprocess.run([sys.executable, "-c", _FACTORY_KERNEL_RUN], env=env,
                              capture_output=True, text=True, check=True)
        return tuple(map(int, done.stdout.split()[-2:]))

    assert hits_and_misses() == (0, 1)    # compiled and written
    assert hits_and_misses() == (1, 0)    # a fresh process loads it


_TWO_FORMATS_RUN = """
import sys, torch
from qsync_lab.kernels import dequantize_int8, float_decode_sum
g = torch.Generator().manual_seed(0)
x, q = torch.randn(2, 5000, generator=g), torch.randint(-127, 128, (5000,), dtype=torch.int8)
for fmt in sys.argv[1:]:
    rows = x.to({"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt])
    same = (torch.equal(float_decode_sum(rows), float_decode_sum(rows, backend="reference"))
            and torch.equal(dequantize_int8(q, 0.01, fmt=fmt),
                            dequantize_int8(q, 0.01, fmt=fmt, backend="reference")))
    print(fmt, same)
"""


def test_kernels_of_two_formats_cached_by_two_processes_run_together(tmp_path):
    """Each format's factory kernels compiled and cached by a process of its own, then both
    loaded by one process: each runs its own format (a helper linked by a name common to
    both formats once made the second kernel run the first's widening)."""
    if type(getattr(cpu.int8._quantize, "_cache", None)).__name__ != "FunctionCache":
        pytest.skip("no disk cache in this install")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}

    def run(*formats):
        done = subprocess.run([sys.executable, "-c", _TWO_FORMATS_RUN, *formats], env=env,
                              capture_output=True, text=True, check=True)
        return done.stdout.split()

    formats = ("fp8_e4m3", "fp8_e5m2")
    for fmt in formats:
        assert run(fmt) == [fmt, "True"]
    assert run(*formats) == [formats[0], "True", formats[1], "True"]
    assert run(*reversed(formats)) == [formats[1], "True", formats[0], "True"]
