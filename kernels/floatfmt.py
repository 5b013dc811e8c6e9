"""Float-format emulation on float32 bit patterns: one scalar source for every backend.

A format is a tuple of four ints ``(E, M, SAT, NAN)``:

* ``E`` exponent bits (1..8) and ``M`` mantissa bits (0..23), exponent bias ``2**(E-1)-1``,
  subnormals kept, round-to-nearest-even everywhere (a mantissa carry moves into the next
  binade, and out of the top binade to infinity or to the saturation value);
* ``SAT = 0``: IEEE-like, the top exponent is reserved for Inf/NaN and overflow gives Inf;
  ``SAT = 1``: OCP "fn" (e4m3fn), the top exponent holds normal numbers, only
  ``S.1111.111`` is NaN, and finite overflow and ±Inf saturate to ±max (exactly what
  ``tensor.to(torch.float8_e4m3fn)`` does in torch 2.13);
* ``NAN``: how a NaN is encoded, copied from torch's casts: ``NAN_PAYLOAD`` (fp16: sign,
  all-ones exponent, quiet bit, top payload bits), ``NAN_ONES`` (fp8: sign and all ones),
  ``NAN_ALL`` (bf16: every bit set, 0xFFFF).

``encode`` maps float32 bits (an unsigned 32-bit int) to the format's code, bit-exact with
torch's cast; ``round_bits`` maps float32 bits to the float32 bits of the nearest
representable value (emulation held in float32, like CPD's ``cast_precision`` without its
bugs). NaN inputs come back unchanged from ``round_bits``.

The functions are branch-free (for speed: the CPU kernels vectorise them): every range's
result is computed with 32-bit integer bit arithmetic and picked by selects on float
compares of ``|x|``. Subnormal results use exact float additions of a power of two whose ulp
is the format's quantum (the FPU's RNE does the rounding; no FMA can arise, no
flush-to-zero is assumed anywhere), so results are identical on every backend. ``build(jit)`` compiles the set with a Numba decorator (``njit`` or
``cuda.jit(device=True)``); the plain functions are the simulator's and the tests' versions.
"""

from types import SimpleNamespace

import numpy as np

u32 = np.uint32
f32 = np.float32

NAN_PAYLOAD = 0
NAN_ONES = 1
NAN_ALL = 2

FP16 = (5, 10, 0, NAN_PAYLOAD)
BF16 = (8, 7, 0, NAN_ALL)
FP8_E4M3 = (4, 3, 1, NAN_ONES)
FP8_E5M2 = (5, 2, 0, NAN_ONES)
FP32 = (8, 23, 0, NAN_PAYLOAD)  # identity; used for exact power-of-two rescaling


def ieee_format(exp_bits, man_bits):
    """Return the format tuple of an IEEE-like (exp_bits, man_bits) format (CPD style)."""
    return (int(exp_bits), int(man_bits), 0, NAN_PAYLOAD)


def constants(fmt):
    """Return the loop-invariant integer constants of ``fmt`` used by ``encode``/``decode``.

    ``(sh, odd, half_m1, rebias, emin_bits, magic_bits, top_bits, limit, nan_base, pmask,
    sign_sh, mag_mask, inf_code, norm_min)``: the mantissa shift ``23 - M``, the RNE addends, the
    exponent re-bias ``(127 - bias) << M``, float32 bits of the smallest normal ``2**emin``
    and of ``2**(emin + 23 - M)`` (whose ulp is the subnormal quantum), float32 bits of the
    smallest value that rounds to the top code ``limit``-or-beyond (``max + ulp/2``, or the
    next binade when that is not a float32), the NaN code pieces, the shift that moves the
    float32 sign bit to the format's, and the magnitude mask, the Inf code (past the
    magnitudes if none) and the smallest normal code ``2**M``.
    Every shift amount is masked to 0..31 so compilers can keep 32-bit lanes.
    """
    E, M, sat, nan_mode = fmt
    bias = (1 << (E - 1)) - 1
    sh = 23 - M
    odd = 1 if sh > 0 else 0
    exp_all = ((1 << E) - 1) << M
    emax_b = 127 + (1 << E) - 1 - bias - (0 if sat else 1)
    top = ((1 << M) - 2) if sat else ((1 << M) - 1)
    if sh > 0:
        top_bits = (emax_b << 23) | (top << sh) | (1 << (sh - 1))
    else:
        top_bits = (emax_b + 1) << 23
    limit = (exp_all | ((1 << M) - 2)) if sat else exp_all
    if nan_mode == NAN_PAYLOAD:
        nan_base = exp_all | ((1 << M) >> 1)
        pmask = 0x7FFFFF
    elif nan_mode == NAN_ONES:
        nan_base = exp_all | ((1 << M) - 1)
        pmask = 0
    else:
        nan_base = (1 << (E + M + 1)) - 1
        pmask = 0
    return (
        sh & 31, odd, ((1 << sh) >> 1) - odd, (127 - bias) << M, (128 - bias) << 23,
        (128 - bias + sh) << 23, top_bits, limit, nan_base, pmask, (31 - E - M) & 31,
        (1 << (E + M)) - 1, (1 << (E + M)) if sat else exp_all, 1 << M,
    )


def _make_encode(consts):
    def encode(b, fmt):
        """Return the code of float32 bits ``b`` (0 <= b < 2**32) in format ``fmt``.

        Branch-free: the normal-range result (RNE on the float32 bits), the subnormal result
        (the FPU rounds ``|x| + 2**(emin + 23 - M)``, exact) and the overflow/NaN codes are
        all computed and picked by selects, so a vectorising compiler emits blends. Float
        compares on ``|x|`` pick the range; NaN fails every compare.
        """
        sh, odd, half_m1, rebias, emin_bits, magic_bits, top_bits, limit, nan_base, pmask, \
            sign_sh, _, _, _ = consts(fmt)
        b = u32(b)
        a = u32(b & u32(0x7FFFFFFF))
        ax = a.view(f32)
        fmin = u32(emin_bits).view(f32)
        sign = u32(u32(b & u32(0x80000000)) >> u32(sign_sh))
        # normal: round the float32 bits themselves; a mantissa carry moves into the exponent
        an = u32(f32(max(ax, fmin)).view(u32))
        mag_n = u32(u32((an + u32(half_m1) + ((an >> u32(sh)) & u32(odd))) >> u32(sh))
                    - u32(rebias))
        # subnormal in the format: count quanta of 2**(emin - M), rounded by the FPU
        magic = u32(magic_bits)
        # (min first: NaN lanes must not reach float arithmetic, where sNaN would signal)
        mag_s = u32(f32(min(fmin, ax) + magic.view(f32)).view(u32) - magic)
        mag = mag_n if ax >= fmin else mag_s
        mag = u32(limit) if ax >= u32(top_bits).view(f32) else mag
        nan_code = u32(sign | u32(nan_base) | ((a & u32(pmask)) >> u32(sh)))
        return u32(sign | mag) if ax == ax else nan_code

    return encode


def _make_decode(consts):
    def decode(code, fmt):
        """Return the float32 bits of a non-NaN code in format ``fmt`` (branch-free)."""
        sh, _, _, rebias, _, magic_bits, _, _, _, _, sign_sh, mag_mask, inf_code, norm_min = \
            consts(fmt)
        code = u32(code)
        mag = u32(code & u32(mag_mask))
        sign = u32(u32(code & u32(mag_mask + 1)) << u32(sign_sh))
        normal = u32(u32(mag + u32(rebias)) << u32(sh))
        # mag * 2**(emin - M) for subnormal codes, exactly: (2**(emin+23-M) + mag·ulp) - 2**(...)
        magic = u32(magic_bits)
        small = min(mag, u32(norm_min))
        sub = f32(u32(magic + small).view(f32) - magic.view(f32)).view(u32)
        bits = normal if mag >= u32(norm_min) else u32(sub)
        bits = u32(0x7F800000) if mag >= u32(inf_code) else bits
        return u32(bits | sign)

    return decode


def _make_round(enc, dec):
    def round_bits(b, fmt):
        """Return the float32 bits of ``b`` rounded to ``fmt`` (NaN bits unchanged)."""
        b = u32(b)
        r = dec(enc(b, fmt), fmt)
        return r if u32(b & u32(0x7FFFFFFF)) <= u32(0x7F800000) else b

    return round_bits


encode = _make_encode(constants)
decode = _make_decode(constants)
round_bits = _make_round(encode, decode)


def build(jit):
    """Compile ``encode``, ``decode`` and ``round_bits`` with the decorator ``jit``."""
    consts = jit(constants)
    enc = jit(_make_encode(consts))
    dec = jit(_make_decode(consts))
    return SimpleNamespace(encode=enc, decode=dec, round_bits=jit(_make_round(enc, dec)))
