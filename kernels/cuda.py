"""CUDA kernels (``numba.cuda.jit``) with host launchers that mirror ``cpu``'s signatures.

Each public function here takes the same arguments as its ``cpu`` namesake (device
arrays on a GPU; NumPy arrays under ``NUMBA_ENABLE_CUDASIM=1``) and launches a grid-stride
kernel. Reductions use shared memory and one atomic per block (the simulator has no warp
shuffles). The scalar numerics are the very functions of ``floatfmt.py`` and ``rng.py``
compiled as device functions. NVVM fuses ``a*b + c`` into one FMA (one rounding instead
of two) whatever the fastmath setting, so every product whose rounding matters to a sum is
taken with :func:`_mul` (``fmul_rn``, which is never fused): a GPU then matches the CPU and
the reference bit for bit. Kernels compile on first launch and run on torch's current
stream, so they order with the torch work before and after them.
"""

import math

import numpy as np
from numba import cuda
from numba.core import config

from . import floatfmt, rng

_device = cuda.jit(device=True)
_ff = floatfmt.build(_device)
ff_encode = _ff.encode
ff_round = _ff.round_bits
ff_cast_value = _ff.cast_value
exp_dither_code = _ff.exp_dither_code
exp_dither_value = _ff.exp_dither_value
rng_bits = _device(rng.rng_bits)

SIMULATED = bool(config.ENABLE_CUDASIM)
TPB = 32 if SIMULATED else 256  # threads per block (a power of two)
MAX_BLOCKS = 2 if SIMULATED else 8192
SEGMENT = 8 * TPB  # elements per block-step of the abs-max reduction
_UNIT24 = np.float32(2.0**-24)


if SIMULATED:

    @_device
    def _mul(a, b):
        return a * b

else:
    from numba.cuda import libdevice

    _mul = libdevice.fmul_rn  # float32 a * b, rounded, never fused into an FMA


def _stream():
    """Torch's current CUDA stream (0, the default, in the simulator): a kernel runs in order
    with the torch work around it, as a torch op would, in any stream context."""
    if SIMULATED:
        return 0
    import torch

    return cuda.external_stream(torch.cuda.current_stream().cuda_stream)


def _launch(kernel, blocks):
    """``kernel`` configured for ``blocks`` blocks of ``TPB`` threads on torch's stream."""
    return kernel[blocks, TPB, _stream()]


def _blocks(n):
    return max(1, min(MAX_BLOCKS, -(-n // TPB)))


@_device
def _block_max(sm, tid):
    step = TPB // 2
    while step > 0:
        if tid < step:
            sm[tid] = max(sm[tid], sm[tid + step])
        cuda.syncthreads()
        step //= 2


@_device
def _add_block_sum(sm, tid, acc, out):
    """Add the sum of the block's threads' ``acc`` to ``out[0]``: a tree sum in the shared
    ``sm`` (one slot a thread), then one atomic add."""
    sm[tid] = acc
    cuda.syncthreads()
    step = TPB // 2
    while step > 0:
        if tid < step:
            sm[tid] += sm[tid + step]
        cuda.syncthreads()
        step //= 2
    if tid == 0:
        cuda.atomic.add(out, 0, sm[0])


@_device
def _int8_code(xj, div, qmax, stochastic, key, j):
    """Code of one element, as in ``reference.quantize`` (v clamped first: same result)."""
    hi = np.float32(qmax)
    v = min(max(xj / div, -hi - np.float32(1)), hi + np.float32(1))
    if stochastic:
        f = math.floor(v)
        u = np.float32(rng_bits(key, j) >> 8) * _UNIT24
        q = f + 1 if u < v - np.float32(f) else f
    else:
        q = round(v)
    return min(max(q, -qmax), qmax)


# ----------------------------------------------------------------------------- kernels


@cuda.jit
def _absmax_kernel(xb, mask, inner, nch, out):
    sm = cuda.shared.array(TPB, dtype=np.int64)
    tid = cuda.threadIdx.x
    per_row = -(-inner // SEGMENT)
    total = (xb.size // inner) * per_row
    for s in range(cuda.blockIdx.x, total, cuda.gridDim.x):
        row = s // per_row
        start = row * inner + (s % per_row) * SEGMENT
        stop = min(start + SEGMENT, (row + 1) * inner)
        m = 0
        for j in range(start + tid, stop, TPB):
            m = max(m, np.int64(xb[j]) & mask)
        sm[tid] = m
        cuda.syncthreads()
        _block_max(sm, tid)
        if tid == 0:
            cuda.atomic.max(out, row % nch, sm[0])
        cuda.syncthreads()


@cuda.jit
def _absmax_atomic_kernel(xb, mask, inner, nch, out):
    for j in range(cuda.grid(1), xb.size, cuda.gridsize(1)):
        v = np.int64(xb[j]) & mask
        if v > 0:
            cuda.atomic.max(out, (j // inner) % nch, v)


@cuda.jit
def _quantize_kernel(x, scales, inner, nch, qmax, stochastic, key, out):
    for j in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        s = scales[(j // inner) % nch]
        div = s if s > 0 else np.float32(1)
        out[j] = _int8_code(x[j], div, qmax, stochastic, key, j)


@cuda.jit
def _dequantize_kernel(q, scales, inner, nch, out):
    for j in range(cuda.grid(1), q.size, cuda.gridsize(1)):
        out[j] = np.float32(q[j]) * scales[(j // inner) % nch]


@cuda.jit
def _fake_quantize_kernel(x, scales, inner, nch, stochastic, key, out_fmt, out, sse):
    sm = cuda.shared.array(TPB, dtype=np.float64)
    tid = cuda.threadIdx.x
    reround = out_fmt[1] < 23
    acc = 0.0
    for j in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        s = scales[(j // inner) % nch]
        div = s if s > 0 else np.float32(1)
        y = np.float32(_int8_code(x[j], div, 127, stochastic, key, j)) * s
        if reround:
            y = np.uint32(ff_round(np.float32(y).view(np.uint32), out_fmt)).view(np.float32)
        out[j] = y
        d = np.float64(y) - np.float64(x[j])
        acc += d * d
    _add_block_sum(sm, tid, acc, sse)


@cuda.jit
def _float_encode_kernel(xb, fmt, out):
    for j in range(cuda.grid(1), xb.size, cuda.gridsize(1)):
        out[j] = ff_encode(xb[j], fmt)


@cuda.jit
def _float_decode_kernel(codes, table, out):
    for j in range(cuda.grid(1), codes.size, cuda.gridsize(1)):
        out[j] = table[codes[j]]


@_device
def _decoded_column_sum(codes, rows, stride, table, j):
    s = np.float32(0)
    for r in range(rows):
        s += table[codes[r * stride + j]]
    return s


@cuda.jit
def _float_decode_sum_kernel(codes, rows, stride, table, scale, out):
    for j in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[j] = _decoded_column_sum(codes, rows, stride, table, j) * scale


@cuda.jit
def _dequantize_sum_kernel(q, stride, scales, divisor, out):
    n = out.size
    for j in range(cuda.grid(1), n, cuda.gridsize(1)):
        s = np.float32(0)
        for r in range(scales.size):
            s += _mul(np.float32(q[r * stride + j]), scales[r])
        out[j] = s / divisor


@cuda.jit
def _float_quantize_kernel(x, scales, fmt, codes, values):
    s = scales[0]
    for j in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        b = np.float32(x[j] / s).view(np.uint32)
        c = ff_encode(b, fmt)
        codes[j] = c
        values[j] = ff_cast_value(b, c, ff_round(b, fmt), fmt)


@cuda.jit
def _float_round_kernel(x, xb, p1, p2, fmt, out):
    prescale = p1 != 1 or p2 != 1
    for j in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        if prescale:
            out[j] = ff_round(np.float32(x[j] * p1 * p2).view(np.uint32), fmt)
        else:
            out[j] = ff_round(xb[j], fmt)


@cuda.jit
def _sum_squares_kernel(x, out):
    sm = cuda.shared.array(TPB, dtype=np.float64)
    tid = cuda.threadIdx.x
    acc = 0.0
    for j in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        d = np.float64(x[j])
        acc += d * d
    _add_block_sum(sm, tid, acc, out)


@cuda.jit
def _exp_dither_encode_kernel(x, m, key, out):
    div = m if m > 0 else np.float32(1)
    for j in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        out[j] = exp_dither_code(x[j], div, m, rng_bits(key, j))


@cuda.jit
def _exp_dither_decode_kernel(codes, m, out):
    for j in range(cuda.grid(1), codes.size, cuda.gridsize(1)):
        out[j] = exp_dither_value(codes[j], m)


@cuda.jit
def _cgx_meta_kernel(x, bucket, levels, meta):
    smin = cuda.shared.array(TPB, dtype=np.float32)
    smax = cuda.shared.array(TPB, dtype=np.float32)
    tid = cuda.threadIdx.x
    n = x.size
    for g in range(cuda.blockIdx.x, meta.shape[0], cuda.gridDim.x):
        start = g * bucket
        stop = min(n, start + bucket)
        mn = x[start]
        mx = x[start]
        special = 0
        for j in range(start + tid, stop, TPB):
            mn = min(mn, x[j])
            mx = max(mx, x[j])
            special |= (x[j].view(np.uint32) & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
        smin[tid] = mn
        smax[tid] = mx
        special = cuda.syncthreads_or(special)
        step = TPB // 2
        while step > 0:
            if tid < step:
                smin[tid] = min(smin[tid], smin[tid + step])
                smax[tid] = max(smax[tid], smax[tid + step])
            cuda.syncthreads()
            step //= 2
        if tid == 0:
            meta[g, 0] = np.float32(np.nan) if special else smin[0]
            meta[g, 1] = np.float32((np.float64(smax[0]) - np.float64(smin[0])) / levels)
        cuda.syncthreads()


@cuda.jit
def _cgx_encode_kernel(x, meta, bucket, bits, stochastic, key, payload):
    n = x.size
    levels = (1 << bits) - 1
    for blk in range(cuda.grid(1), payload.size // bits, cuda.gridsize(1)):
        acc = 0
        for t in range(8):
            j = blk * 8 + t
            if j < n:
                g = j // bucket
                unit = meta[g, 1]
                inv = np.float32(1) / unit if unit > 0 else np.float32(0)
                r = np.float32(0.5)
                if stochastic:
                    h = rng_bits(key, j >> 1) >> (16 * (j & 1))
                    r = np.float32(h & 0xFFFF) * np.float32(2.0**-16)
                v = _mul(x[j] - meta[g, 0], inv) + r
                v = v if v >= 0 else np.float32(0)  # NaN (a marked group) too
                q = int(math.floor(min(v, np.float32(levels))))
                acc |= q << (t * bits)
        for t in range(bits):
            payload[blk * bits + t] = (acc >> (8 * t)) & 0xFF


@cuda.jit
def _cgx_decode_kernel(payload, meta, bucket, bits, accumulate, out):
    n = out.size
    mask = (1 << bits) - 1
    for blk in range(cuda.grid(1), payload.size // bits, cuda.gridsize(1)):
        acc = 0
        for t in range(bits):
            acc |= np.int64(payload[blk * bits + t]) << (8 * t)
        for t in range(8):
            j = blk * 8 + t
            if j < n:
                g = j // bucket
                q = np.float32((acc >> (t * bits)) & mask)
                value = meta[g, 0] + _mul(meta[g, 1], q)
                out[j] = out[j] + value if accumulate else value


# ----------------------------------------------------------------------------- launchers


def absmax_bits(xb, mask, inner, nch, out):
    """Per-channel max of ``xb & mask`` into int64 ``out`` (zeroed by the caller).

    Rows shorter than a block reduce with one atomic per element instead.
    """
    if inner < TPB and nch > 1:
        _launch(_absmax_atomic_kernel, _blocks(xb.size))(xb, mask, inner, nch, out)
        return
    rows = xb.size // inner
    grid = max(1, min(MAX_BLOCKS, rows * -(-inner // SEGMENT)))
    _launch(_absmax_kernel, grid)(xb, mask, inner, nch, out)


def quantize(x, scales, inner, nch, qmax, stochastic, key, out):
    _launch(_quantize_kernel, _blocks(x.size))(x, scales, inner, nch, qmax, stochastic, key, out)


def dequantize(q, scales, inner, nch, out):
    _launch(_dequantize_kernel, _blocks(q.size))(q, scales, inner, nch, out)


def fake_quantize(x, scales, inner, nch, stochastic, key, out_fmt, out, sse_out):
    _launch(_fake_quantize_kernel, _blocks(x.size))(
        x, scales, inner, nch, stochastic, key, out_fmt, out, sse_out
    )


def float_encode(xb, fmt, out):
    _launch(_float_encode_kernel, _blocks(xb.size))(xb, fmt, out)


def float_decode(codes, table, out):
    _launch(_float_decode_kernel, _blocks(codes.size))(codes, table, out)


def float_decode_sum(codes, rows, stride, table, scale, out):
    _launch(_float_decode_sum_kernel, _blocks(out.size))(codes, rows, stride, table,
                                                         np.float32(scale), out)


def dequantize_sum(q, stride, scales, divisor, out):
    _launch(_dequantize_sum_kernel, _blocks(out.size))(q, stride, scales, np.float32(divisor), out)


def float_quantize(x, scales, fmt, codes, values):
    _launch(_float_quantize_kernel, _blocks(x.size))(x, scales, fmt, codes, values)


def float_round(x, p1, p2, fmt, out):
    _launch(_float_round_kernel, _blocks(x.size))(
        x, x.view(np.uint32), np.float32(p1), np.float32(p2), fmt, out
    )


def sum_squares(x, out):
    _launch(_sum_squares_kernel, _blocks(x.size))(x, out)


def exp_dither_encode(x, m, key, out):
    _launch(_exp_dither_encode_kernel, _blocks(x.size))(x, np.float32(m), key, out)


def exp_dither_decode(codes, m, out):
    _launch(_exp_dither_decode_kernel, _blocks(codes.size))(codes, np.float32(m), out)


def cgx_meta(x, bucket, levels, meta):
    _launch(_cgx_meta_kernel, max(1, min(MAX_BLOCKS, meta.shape[0])))(x, bucket, levels, meta)


def cgx_encode(x, meta, bucket, bits, stochastic, key, payload):
    _launch(_cgx_encode_kernel, _blocks(payload.size // bits))(
        x, meta, bucket, bits, stochastic, key, payload
    )


def cgx_meta_encode(x, bucket, bits, stochastic, key, meta, payload):
    """:func:`cgx_meta` then :func:`cgx_encode` (NaN/Inf are found by the caller's check)."""
    cgx_meta(x, bucket, (1 << bits) - 1, meta)
    cgx_encode(x, meta, bucket, bits, stochastic, key, payload)


def cgx_decode(payload, meta, bucket, bits, accumulate, out):
    _launch(_cgx_decode_kernel, _blocks(payload.size // bits))(payload, meta, bucket, bits,
                                                               accumulate, out)


# ------------------------------------------------- scalars read on the device (no host sync)
# Variants of the launchers above whose scalar (a scale, Global-QSGD's shared max) is the
# first element of a float32 device array rather than a Python number: a value computed on
# the GPU (an all-reduced max, a per-parameter scale) feeds the kernel without being read
# back to the host. Each computes exactly what its namesake computes with that number.


@cuda.jit
def _float_decode_sum_dev_kernel(codes, rows, stride, table, scale, out):
    sc = scale[0]
    for j in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[j] = _decoded_column_sum(codes, rows, stride, table, j) * sc


@cuda.jit
def _exp_dither_encode_dev_kernel(x, m_arr, key, out):
    m = m_arr[0]
    div = m if m > 0 else np.float32(1)
    for j in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        out[j] = exp_dither_code(x[j], div, m, rng_bits(key, j))


@cuda.jit
def _exp_dither_decode_dev_kernel(codes, m_arr, out):
    m = m_arr[0]
    for j in range(cuda.grid(1), codes.size, cuda.gridsize(1)):
        out[j] = exp_dither_value(codes[j], m)


def float_decode_sum_dev(codes, rows, stride, table, scale, out):
    """:func:`float_decode_sum` with ``scale`` a one-element float32 device array."""
    _launch(_float_decode_sum_dev_kernel, _blocks(out.size))(codes, rows, stride, table, scale,
                                                             out)


def exp_dither_encode_dev(x, m, key, out):
    """:func:`exp_dither_encode` with ``m`` a one-element float32 device array."""
    _launch(_exp_dither_encode_dev_kernel, _blocks(x.size))(x, m, key, out)


def exp_dither_decode_dev(codes, m, out):
    """:func:`exp_dither_decode` with ``m`` a one-element float32 device array."""
    _launch(_exp_dither_decode_dev_kernel, _blocks(codes.size))(codes, m, out)
