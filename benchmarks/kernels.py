"""Throughput of the quantization kernels beside memory bandwidth and torch equivalents.

Run: ``.venv/bin/python benchmarks/kernels.py [--elements 67108864] [--repeats 5] [--only TEXT]
[--devices cpu cuda] [--launch-elements 65536]``

For each routine on a float32 input of ``--elements`` elements it prints GB/s of bytes read
plus bytes written (counted per element in the ``B/elem`` column; fused routines count every
pass, e.g. abs-max + quantize reads the input twice), the STREAM-like copy bandwidth measured
in the same run, the percentage of it, the closest torch equivalent's GB/s (same byte count)
and our speed-up over it. Times are medians of ``--repeats`` runs after one warm-up. The CPU
table always runs; a second table for CUDA tensors runs when CUDA is available.

Each routine is timed twice: as users call it by default (``alloc``: a new output per call, so
its first-touch page faults are included; large CPU outputs are advised as huge pages) and
with a preallocated ``out=`` tensor reused across calls (``out=``; "-" where the routine
has no ``out=``). The torch column is torch's allocating call; "x torch" compares both of
ours with it. The byte count is what the routine must move: a given-scale quantize reads x
once (its NaN/Inf check is fused), abs-max + quantize reads it twice. The per-channel rows
view x as ``[elements / 4096, 4096]`` and take the channels along the last axis (one scale
per column). The 1-minute load average is printed before and after: compare only runs on a
quiet machine (timings of memory-bound loops on 2 cores halve under a competing job).

A second table per device gives each routine's launch overhead at ``--launch-elements``
(65,536) elements, where the work is small and a call costs what issuing it costs: the
host's µs per call (:data:`LAUNCH_CALLS` calls back to back, one synchronise after them,
so on a GPU the host only issues them) and, on CUDA, the device's µs per call (the same
calls queued behind a spin kernel, :func:`~qsync_lab.profile.timing.hold_stream`, so CUDA
events time the kernels alone), for ours (``out=`` where it has one) and torch's
equivalent. Where host µs exceed device µs, a training step that calls the routine is
bound by its launches, not by bandwidth.
"""

import os

# torch's OpenMP workers spin after each op and steal the cores from Numba's pool; let them sleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics
import time
import warnings

import numpy as np  # noqa: E402
import torch  # noqa: E402
import numba  # noqa: E402
from numba import njit, prange  # noqa: E402

from qsync_lab import kernels as K  # noqa: E402


@njit(parallel=True)
def _copy(src, dst):
    for i in prange(src.size):
        dst[i] = src[i]


def _median_s(fn, repeats, sync):
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_CHANNELS = 4096
LAUNCH_CALLS = 50  #: calls per launch-overhead sample


def _per_channel(x):
    """``x`` as [rows, 4096] (channels along the last axis), with its per-channel scales."""
    x2 = x[: x.numel() // _CHANNELS * _CHANNELS].reshape(-1, _CHANNELS)
    return x2, (x2.abs().amax(dim=0) / 127).contiguous()


def _routines(x):
    """(name, bytes per element, ours, ours with out= or None, torch equivalent or None)."""
    amax = float(x.abs().max())
    scale = torch.tensor(amax / 127, device=x.device)
    codes = K.quantize_int8(x).codes
    inv = 127 / amax
    o8 = torch.empty_like(x, dtype=torch.int8)
    o32 = torch.empty_like(x)
    o16 = torch.empty_like(x, dtype=torch.float16)
    ob16 = torch.empty_like(x, dtype=torch.bfloat16)
    oe4 = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    oe5 = torch.empty_like(x, dtype=torch.float8_e5m2)

    def torch_quant():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.quantize_per_tensor(x, amax / 127, 0, torch.qint8)

    def torch_amax_quant():
        s = float(x.abs().amax()) / 127
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.quantize_per_tensor(x, s, 0, torch.qint8)

    packed = K.cgx_encode(x, 4, 512)
    cgx_bytes = round(4 + 4 / 8 + 8 / 512, 2)  # x read once; codes and (min, unit) written
    e5 = K.float_encode(x, "fp8_e5m2")
    e5_rows = torch.stack([e5, e5])  # two ranks' gathered payloads
    q_rows = torch.stack([codes, codes])  # two ranks' QSGD codes
    q_norms = [float(amax), 2 * float(amax)]
    q_scales = torch.tensor([[v / 127] for v in q_norms], device=x.device)
    x2, cscale = _per_channel(x)
    zp = torch.zeros(_CHANNELS, dtype=torch.long, device=x.device)
    c8 = torch.empty_like(x2, dtype=torch.int8)
    c32 = torch.empty_like(x2)
    ccodes = K.quantize_int8(x2, axis=-1).codes

    def torch_quant_pc(scale=None):
        s = x2.abs().amax(dim=0) / 127 if scale is None else scale
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.quantize_per_channel(x2, s.double(), zp, 1, torch.qint8)

    cgx_out = (packed.payload.clone(), packed.meta.clone())
    return [
        ("absmax", 4, lambda: K.absmax(x), None, lambda: x.abs().amax()),
        ("int8 quantize, given scale", 5, lambda: K.quantize_int8(x, scale=scale),
         lambda: K.quantize_int8(x, scale=scale, out=o8), torch_quant),
        ("int8 absmax+quantize (RNE)", 9, lambda: K.quantize_int8(x),
         lambda: K.quantize_int8(x, out=o8), torch_amax_quant),
        ("int8 absmax+quantize (stochastic)", 9,
         lambda: K.quantize_int8(x, rounding="stochastic"),
         lambda: K.quantize_int8(x, rounding="stochastic", out=o8),
         lambda: torch.clamp(torch.floor(x * (127 / float(x.abs().amax())) + torch.rand_like(x)),
                             -127, 127).to(torch.int8)),
        ("int8 dequantize", 5, lambda: K.dequantize_int8(codes, scale),
         lambda: K.dequantize_int8(codes, scale, out=o32), lambda: codes.float() * scale),
        ("int8 quantize, per-ch. last axis", 5,
         lambda: K.quantize_int8(x2, axis=-1, scale=cscale),
         lambda: K.quantize_int8(x2, axis=-1, scale=cscale, out=c8),
         lambda: torch_quant_pc(cscale)),
        ("int8 absmax+quantize, per-ch. last", 9, lambda: K.quantize_int8(x2, axis=-1),
         lambda: K.quantize_int8(x2, axis=-1, out=c8), torch_quant_pc),
        ("int8 dequantize, per-ch. last axis", 5,
         lambda: K.dequantize_int8(ccodes, cscale, axis=-1),
         lambda: K.dequantize_int8(ccodes, cscale, axis=-1, out=c32),
         lambda: ccodes.float() * cscale),
        ("int8 fake-quantize + stats", 12, lambda: K.fake_quantize_int8(x),
         lambda: K.fake_quantize_int8(x, out=o32),
         lambda: torch.fake_quantize_per_tensor_affine(x, float(x.abs().amax()) / 127, 0,
                                                        -127, 127)),
        ("cast fp32->fp16", 6, lambda: K.float_encode(x, "fp16"),
         lambda: K.float_encode(x, "fp16", out=o16), lambda: x.to(torch.float16)),
        ("cast fp32->bf16", 6, lambda: K.float_encode(x, "bf16"),
         lambda: K.float_encode(x, "bf16", out=ob16), lambda: x.to(torch.bfloat16)),
        ("cast fp32->fp8 e4m3", 5, lambda: K.float_encode(x, "fp8_e4m3"),
         lambda: K.float_encode(x, "fp8_e4m3", out=oe4), lambda: x.to(torch.float8_e4m3fn)),
        ("cast fp32->fp8 e5m2", 5, lambda: K.float_encode(x, "fp8_e5m2"),
         lambda: K.float_encode(x, "fp8_e5m2", out=oe5), lambda: x.to(torch.float8_e5m2)),
        ("fake cast e4m3 (fp32 out)", 8, lambda: K.float_round(x, "fp8_e4m3"),
         lambda: K.float_round(x, "fp8_e4m3", out=o32),
         lambda: x.to(torch.float8_e4m3fn).float()),
        ("APS e5m2 scaled cast (codes only)", 5, lambda: K.float_encode(x, "fp8_e5m2", scale=0.125),
         lambda: K.float_encode(x, "fp8_e5m2", scale=0.125, out=oe5),
         lambda: (x / 0.125).to(torch.float8_e5m2)),
        ("APS e5m2 quantize (given shift)", 8, lambda: K.aps_quantize(x, 3, (5, 2)),
         lambda: K.aps_quantize(x, 3, (5, 2), out=o32),
         lambda: (x * 8).to(torch.float8_e5m2).float()),
        ("Global-QSGD std encode (+check)", 9,
         lambda: K.global_qsgd_encode(x, amax, 4, seed=1), None,
         lambda: torch.clamp(torch.floor(x * (31 * inv / 127) + torch.rand_like(x)),
                             -31, 31).to(torch.int8)),
        ("QSGD s=15 encode (norm+quant)", 9, lambda: K.qsgd_encode(x, 15, seed=1),
         lambda: K.qsgd_encode(x, 15, seed=1, out=o8),
         lambda: torch.clamp(torch.floor(x * (15 / float(torch.linalg.vector_norm(x)))
                                          + torch.rand_like(x)), -15, 15).to(torch.int8)),
        ("QSGD norm (float64 sum)", 4, lambda: K.l2norm(x), None,
         lambda: torch.linalg.vector_norm(x, dtype=torch.float64)),
        ("QSGD mean of 2 payloads", 6, lambda: K.qsgd_decode_sum(q_rows, q_norms, 127, divisor=2),
         lambda: K.qsgd_decode_sum(q_rows, q_norms, 127, divisor=2, out=o32),
         lambda: (q_rows.float() * q_scales).sum(0) / 2),
        ("CGX 4-bit B=512 encode (stochastic)", cgx_bytes, lambda: K.cgx_encode(x, 4, 512),
         lambda: K.cgx_encode(x, 4, 512, out=cgx_out), None),
        ("CGX 4-bit B=512 encode (nearest)", cgx_bytes,
         lambda: K.cgx_encode(x, 4, 512, rounding="nearest"),
         lambda: K.cgx_encode(x, 4, 512, rounding="nearest", out=cgx_out), None),
        ("CGX 4-bit decode", cgx_bytes, lambda: K.cgx_decode(packed), None, None),
        ("CGX 4-bit decode, add to a sum", cgx_bytes + 4, None,
         lambda: K.cgx_decode(packed, out=o32), None),
        ("CGX 4-bit mean of 2 payloads", round(2 * (cgx_bytes - 4) + 4, 2),
         lambda: K.cgx_decode_mean([packed, packed]),
         lambda: K.cgx_decode_mean([packed, packed], out=o32), None),
        ("fp8 e5m2 decode (APS, gathered)", 5, lambda: K.float_decode(e5), None, e5.float),
        ("fp8 e5m2 sum of 2 payloads (APS)", 6, lambda: K.float_decode_sum(e5_rows),
         lambda: K.float_decode_sum(e5_rows, out=o32), lambda: e5_rows.float().sum(0)),
    ]


def _selected_routines(x, only, columns: str):
    """Print a table's head (``routine`` then ``columns``); yield the routines whose names
    contain one of ``only`` (all without it)."""
    head = f"{'routine':34} {columns}"
    print(head)
    print("-" * len(head))
    for routine in _routines(x):
        if not only or any(o.lower() in routine[0].lower() for o in only):
            yield routine


def _table(x, repeats, sync, label, only=None):
    n = x.numel()
    dst = torch.empty_like(x)
    if x.is_cuda:
        copy_s = _median_s(lambda: dst.copy_(x), repeats, sync)
    else:
        copy_s = min(
            _median_s(lambda: dst.copy_(x), repeats, sync),
            _median_s(lambda: _copy(x.numpy(), dst.numpy()), repeats, sync),
        )
    copy_gbs = 8 * n / copy_s / 1e9
    print(f"\n{label}: {n:,} float32 elements, median of {repeats}; copy = {copy_gbs:.1f} GB/s "
          "(read + write)")
    for name, bpe, ours, ours_out, theirs in _selected_routines(
            x, only, f"{'B/elem':>6} {'alloc GB/s':>10} {'%copy':>5} {'out= GB/s':>9} "
            f"{'%copy':>5} {'torch GB/s':>10} {'x torch (alloc/out=)':>20}"):
        try:
            gbs = [bpe * n / _median_s(f, repeats, sync) / 1e9 if f else None
                   for f in (ours, ours_out)]
        except Exception as err:  # noqa: BLE001 - one broken row must not hide the others
            print(f"{name:34} FAILED: {type(err).__name__}: {str(err).splitlines()[0]}")
            continue
        t_gbs = _torch_gbs(theirs, bpe * n, repeats, sync)
        cols = [f"{g:>{w}.1f} {100 * g / copy_gbs:>4.0f}%" if g else f"{'-':>{w}} {'-':>5}"
                for g, w in zip(gbs, (10, 9))]
        ratio = "/".join(f"{g / t_gbs:.2f}" if g else "-" for g in gbs) + "x" if t_gbs else "-"
        print(f"{name:34} {bpe:>6} {cols[0]} {cols[1]} "
              f"{f'{t_gbs:.1f}' if t_gbs else '-':>10} {ratio:>20}", flush=True)


def _launch_table(x, repeats, sync, label, only=None):
    """Host (and, on CUDA, device) µs per call of every routine on the small ``x``."""
    print(f"\n{label}, launch overhead: {x.numel():,} float32 elements, µs per call, median "
          f"of {repeats} x {LAUNCH_CALLS} calls")
    for name, _, ours, ours_out, theirs in _selected_routines(
            x, only, f"{'host us':>8} {'device us':>9} {'torch host':>10} {'torch device':>12}"):
        cols, failures = [], []
        for who, fn in (("ours", ours_out or ours), ("torch", theirs)):
            try:
                cols += _per_call_us(fn, x, repeats, sync) if fn else [None, None]
            except Exception as err:  # noqa: BLE001 - a CPU-only torch op on CUDA, or a
                cols += [None, None]  # routine that fails there: its row says so
                first_line = (str(err).splitlines() or [""])[0][:80]
                failures.append(f"  {who} failed: {type(err).__name__}: {first_line}")
        text = [f"{v:>{w}.1f}" if v is not None else f"{'-':>{w}}"
                for v, w in zip(cols, (8, 9, 10, 12))]
        print(f"{name:34} {' '.join(text)}{''.join(failures)}", flush=True)


def _per_call_us(fn, x, repeats, sync):
    """[host µs per call, device µs per call (None off CUDA)] of ``fn``."""
    def calls():
        for _ in range(LAUNCH_CALLS):
            fn()

    host_us = _median_s(calls, repeats, sync) * 1e6 / LAUNCH_CALLS
    if not x.is_cuda:
        return [host_us, None]
    from qsync_lab.profile.timing import hold_stream

    samples = []
    for _ in range(repeats):
        sync()
        hold_stream(x.device, 2 * host_us * LAUNCH_CALLS + 1000)  # outlasts the issuing
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        calls()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / LAUNCH_CALLS)
    return [host_us, statistics.median(samples)]


def _torch_gbs(theirs, nbytes, repeats, sync):
    """The torch equivalent's GB/s, or None where there is none (or none on this device)."""
    if theirs is None:
        return None
    try:
        return nbytes / _median_s(theirs, repeats, sync) / 1e9
    except (RuntimeError, NotImplementedError):  # e.g. a CPU-only quantized op
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=64 * 2**20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--launch-elements", type=int, default=2**16,
                        help="elements of the launch-overhead table (0: no such table)")
    parser.add_argument("--only", action="append", metavar="TEXT",
                        help="run only routines whose name contains TEXT (repeatable)")
    parser.add_argument("--devices", nargs="+", choices=("cpu", "cuda"), default=["cpu", "cuda"],
                        help="the tables to print (cuda: when CUDA is available)")
    args = parser.parse_args()
    if min(args.elements, args.launch_elements or _CHANNELS) < _CHANNELS:
        parser.error(f"--elements and --launch-elements need at least {_CHANNELS} (one row "
                     "of the per-channel routines' channels)")
    x = torch.randn(args.elements, generator=torch.Generator().manual_seed(0))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, "
          f"numba {numba.__version__} ({numba.get_num_threads()} threads); "
          f"load average {_load()} at start")
    small = x[: args.launch_elements].clone()
    if "cpu" in args.devices:
        _table(x, args.repeats, lambda: None, "CPU", args.only)
        if args.launch_elements:
            _launch_table(small, args.repeats, lambda: None, "CPU", args.only)
    if "cuda" in args.devices and torch.cuda.is_available():
        label = f"CUDA ({torch.cuda.get_device_name()})"
        _table(x.cuda(), args.repeats, torch.cuda.synchronize, label, args.only)
        if args.launch_elements:
            _launch_table(small.cuda(), args.repeats, torch.cuda.synchronize, label, args.only)
    elif "cuda" in args.devices:
        print("\nCUDA: not available, GPU table skipped")
    print(f"load average {_load()} at end")


def _load():
    try:
        return "/".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
