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
flush-to-zero is assumed anywhere), so results are identical on every backend.

``encode_narrow``/``round_narrow`` give the same bits as ``encode``/``round_bits`` for every
one of the 2**32 inputs (checked exhaustively for fp16, both fp8 and CPD formats) when
``is_narrow(fmt)`` (2 <= E <= 7, 1 <= M <= 22), in about half the operations: one FPU rounding
of the clamped magnitude covers the normal, subnormal and overflow ranges, and no subnormal
float32 is created (those take slow microcode assists on x86, and would make the speed depend
on the data). The CPU kernels use them for those formats, and ``round_wide`` (RNE on the
float32 bits, also checked on all 2**32 inputs) for E = 8 formats (bf16, tf32).
``cast_value`` gives the float32 bits torch widens an encoded value to (NaNs included), and
``widen`` those of any code.
``exp_dither_code`` is Global-QSGD's exponential-dithering encoder, shared by the CPU and
CUDA kernels.

``build(jit)`` compiles the set with a Numba decorator (``njit`` or
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
        # normal: round the float32 bits themselves; a mantissa carry moves into the exponent.
        # The sum is < 2**32 (an < 2**31), so truncating it to 32 bits before the shift changes
        # nothing, but it lets LLVM keep the lanes 32 bits wide (Numba widens u32 + u32 to 64
        # bits; without the truncation the shift needs the 64-bit sum and 64-bit lanes).
        an = u32(f32(max(ax, fmin)).view(u32))
        mag_n = u32(u32(u32(an + u32(half_m1) + ((an >> u32(sh)) & u32(odd))) >> u32(sh))
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


def _make_nan_bits(consts):
    def nan_bits(code, fmt):
        """Return the float32 bits torch widens a NaN ``code`` to: its sign, the all-ones
        exponent and its mantissa at the top of float32's."""
        sh, _, _, _, _, _, _, _, _, _, sign_sh, mag_mask, _, norm_min = consts(fmt)
        code = u32(code)
        sign = u32(u32(code & u32(mag_mask + 1)) << u32(sign_sh))
        return u32(sign | u32(0x7F800000) | u32(u32(code & u32(norm_min - 1)) << u32(sh)))

    return nan_bits


def _make_cast_value(nan_bits):
    def cast_value(b, code, r, fmt):
        """Return the float32 bits of ``code``, the ``encode`` of float32 bits ``b``, given
        ``r``, b rounded to ``fmt``: that is ``r``, except for a NaN (``nan_bits``; the NaN
        codes ``encode`` makes have the quiet bit set, or are all ones).
        """
        nan = nan_bits(code, fmt)
        return u32(r) if u32(u32(b) & u32(0x7FFFFFFF)) <= u32(0x7F800000) else nan

    return cast_value


def _make_widen(consts, dec, nan_bits):
    def widen(code, fmt):
        """Return the float32 bits torch widens any ``code`` of ``fmt`` to, NaNs included
        (branch-free: ``decode``, or ``nan_bits`` past the largest non-NaN magnitude, made
        quiet as torch's fp16/fp8 casts do; its bf16 cast, a plain shift, keeps the bits)."""
        _, _, _, _, _, _, _, limit, _, _, _, mag_mask, _, _ = consts(fmt)
        mag = u32(u32(code) & u32(mag_mask))
        quiet = u32(0) if fmt[3] == NAN_ALL else u32(0x00400000)
        nan = u32(nan_bits(code, fmt) | quiet)
        return nan if mag > u32(limit) else dec(code, fmt)

    return widen


def _make_round(enc, dec):
    def round_bits(b, fmt):
        """Return the float32 bits of ``b`` rounded to ``fmt`` (NaN bits unchanged)."""
        b = u32(b)
        r = dec(enc(b, fmt), fmt)
        return r if u32(b & u32(0x7FFFFFFF)) <= u32(0x7F800000) else b

    return round_bits


def is_narrow(fmt):
    """Whether ``encode_narrow``/``round_narrow`` apply to ``fmt``: 2 <= E <= 7, so every
    power of two they form (up to ``2**(emax + 24 - M)``) is a normal float32, and
    1 <= M <= 22: ``c + 2**(e + 23 - M)`` stays in that power's binade, and the FPU's
    tie-to-even picks the even code (with M = 0 the code is the exponent field, whose parity
    is not the sum's last bit)."""
    return 2 <= fmt[0] <= 7 and 1 <= fmt[1] <= 22


def is_wide(fmt):
    """Whether ``round_wide`` applies to ``fmt``: E = 8 (bf16, tf32), IEEE-like, 1 <= M <= 22.

    The format's exponent field is then float32's, so rounding to it is RNE on the float32
    bits themselves, subnormals included, and a carry out of the top binade lands on Inf.
    """
    return fmt[0] == 8 and fmt[2] == 0 and 1 <= fmt[1] <= 22


def round_wide(b, fmt):
    """``round_bits`` for ``is_wide`` formats (the same bits for every input): RNE of the
    magnitude's bits (below 2**31 even after the carry, so no lane overflows), sign kept."""
    sh = u32(23 - fmt[1])
    b = u32(b)
    a = u32(b & u32(0x7FFFFFFF))
    half_m1 = u32(u32(u32(1) << u32(sh - u32(1))) - u32(1))
    r = u32(u32(u32(u32(a + half_m1) + u32(u32(a >> sh) & u32(1))) >> sh) << sh)
    return b if a > u32(0x7F800000) else u32(r | u32(b & u32(0x80000000)))


def _make_narrow_constants(consts):
    def narrow_constants(fmt):
        """``(sh, emin_bits, clamp_bits, step, code_base, nan_base, pmask, sign_sh,
        over_bits)``: from ``constants``, the mantissa shift, float32 bits of ``2**emin``, of
        ``max + ulp/2`` (``top_bits``: it rounds to max for a saturating format, whose max
        has an even mantissa, and past max for an IEEE-like one) and the NaN code pieces and
        sign shift; ``sh << 23`` (added to a power of two's bits: the magic number whose ulp
        is that binade's quantum), ``(128 + sh - bias) << M`` (see ``encode_narrow``) and
        float32 bits of ``2**(emax + 1)``, the first value past the largest finite one."""
        E, M, sat, _ = fmt
        c = consts(fmt)
        bias = (1 << (E - 1)) - 1
        emax_b = 127 + (1 << E) - 1 - bias - (0 if sat else 1)
        return (c[0], c[4], c[6], (23 - M) << 23, (128 + (23 - M) - bias) << M, c[8], c[9],
                c[10], (emax_b + 1) << 23)

    return narrow_constants


def _make_magic_sum(nconsts):
    def magic_sum(a, fmt):
        """``(bits of c + m, bits of m)`` for ``|x|`` (bits ``a``): the rounding step.

        ``c`` is ``|x|`` clamped to ``max + ulp/2`` (an integer min: no NaN or huge value
        reaches float arithmetic), ``m = 2**(max(e, emin) + 23 - M)`` with ``e`` c's exponent:
        the sum's ulp is the format's quantum in c's binade (the subnormal quantum below
        ``2**emin``), so the FPU's RNE rounds once, exactly, and a carry lands on the next
        power of two. It creates no subnormal float32 (those take slow microcode assists).
        """
        _, emin_bits, clamp_bits, step, _, _, _, _, _ = nconsts(fmt)
        ac = min(a, u32(clamp_bits))
        m = u32(max(u32(ac & u32(0x7F800000)), u32(emin_bits)) + u32(step))
        return f32(u32(ac).view(f32) + m.view(f32)).view(u32), m

    return magic_sum


def _make_narrow(nconsts, magic_sum):
    def encode_narrow(b, fmt):
        """``encode`` for ``is_narrow`` formats (the same code for every input), shorter.

        ``bits(c + m) - bits(m)`` counts the quanta of the rounded magnitude: the subnormal
        code below ``2**emin``, and ``2**M + mantissa`` (``2**(M+1)`` after a carry) in the
        binade of ``2**e``, whose code is that plus ``(e + bias - 1) << M``;
        ``bits(m) >> sh`` is ``(max(e, emin) + 127 + sh) << M``, so subtracting
        ``(128 + sh - bias) << M`` gives that offset, and 0 for subnormals. A value past max
        (clamped to ``max + ulp/2``) lands on the Inf code, or on max when saturating.
        """
        sh, _, _, _, code_base, nan_base, pmask, sign_sh, _ = nconsts(fmt)
        b = u32(b)
        a = u32(b & u32(0x7FFFFFFF))
        sign = u32(u32(b & u32(0x80000000)) >> u32(sign_sh))
        s, m = magic_sum(a, fmt)
        mag = u32(u32(s - m) + u32(u32(m >> u32(sh)) - u32(code_base)))
        nan_code = u32(sign | u32(nan_base) | ((a & u32(pmask)) >> u32(sh)))
        return nan_code if a > u32(0x7F800000) else u32(sign | mag)

    def round_narrow(b, fmt):
        """``round_bits`` for ``is_narrow`` formats (the same bits for every input)."""
        over_bits = nconsts(fmt)[8]
        b = u32(b)
        a = u32(b & u32(0x7FFFFFFF))
        s, m = magic_sum(a, fmt)
        r = f32(u32(s).view(f32) - u32(m).view(f32)).view(u32)
        r = u32(0x7F800000) if r >= u32(over_bits) else r
        return b if a > u32(0x7F800000) else u32(r | u32(b & u32(0x80000000)))

    return encode_narrow, round_narrow


encode = _make_encode(constants)
decode = _make_decode(constants)
nan_bits = _make_nan_bits(constants)
cast_value = _make_cast_value(nan_bits)
widen = _make_widen(constants, decode, nan_bits)
round_bits = _make_round(encode, decode)
narrow_constants = _make_narrow_constants(constants)
encode_narrow, round_narrow = _make_narrow(narrow_constants, _make_magic_sum(narrow_constants))


def exp_dither_code(x, div, m, rbits):
    """Global-QSGD exponential-dithering code of float32 ``x`` (``reference.exp_dither_encode``).

    ``m`` is the shared scale M, ``div`` is M (1 when M is 0) and ``rbits`` the element's
    32-bit random hash ``rng_bits(key, index)``. ``r = |x| / div`` in float32 lies in
    ``[2**-k-1, 2**-k)`` and rounds up to ``2**-k`` when ``u24 < 2 * mantissa(r)`` (probability
    ``r * 2**(k+1) - 1``, exactly), else down; the code is a 7-bit exponent ``c`` (value
    ``M * 2**-(c-1)``, 0 = zero) with x's sign in bit 7. Shared by the CPU and CUDA kernels.
    """
    r = f32(abs(x) / div)
    rb = np.int64(r.view(u32))
    eb = rb >> 23
    up = (np.int64(rbits) >> 8) < 2 * (rb & 0x7FFFFF)
    if eb >= 127:
        code = 1
    elif eb >= 1:
        code = 128 - eb - (1 if up else 0)
    else:
        code = 127 if up else 0
    if m <= 0:
        code = 0
    if code > 0 and (np.int64(f32(x).view(u32)) >> 31) != 0:
        code = code | 0x80
    return code


def exp_dither_value(c, m):
    """The value ``±M · 2**-(c-1)`` of exponential-dithering code ``c`` (0: zero) under
    the shared scale ``m`` (float32). Shared by the CPU and CUDA kernels."""
    c = np.int64(c)
    k = (c & 0x7F) - 1
    val = f32(0)
    if k >= 0:
        val = m * np.uint32(max(127 - k, 1) << 23).view(f32)
    return -val if c & 0x80 else val


def build(jit):
    """Compile every scalar function here with the decorator ``jit``."""
    consts = jit(constants)
    enc = jit(_make_encode(consts))
    dec = jit(_make_decode(consts))
    nconsts = jit(_make_narrow_constants(consts))
    enc_n, round_n = (jit(f) for f in _make_narrow(nconsts, jit(_make_magic_sum(nconsts))))
    nan = jit(_make_nan_bits(consts))
    return SimpleNamespace(encode=enc, decode=dec, round_bits=jit(_make_round(enc, dec)),
                           encode_narrow=enc_n, round_narrow=round_n, round_wide=jit(round_wide),
                           cast_value=jit(_make_cast_value(nan)),
                           widen=jit(_make_widen(consts, dec, nan)),
                           exp_dither_code=jit(exp_dither_code),
                           exp_dither_value=jit(exp_dither_value))
