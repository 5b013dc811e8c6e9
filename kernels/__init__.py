"""Quantization kernels: NumPy reference, Numba CPU and CUDA versions, one torch-facing API.

Importing this package is cheap and never needs a GPU. The torch-facing API validates
arguments, converts tensors zero-copy and picks a backend; it is split by routine family:
``reductions.py`` (``absmax``, ``l2norm``), ``int8.py``, ``floats.py`` (float-format casts),
``aps.py``, ``global_qsgd.py``, ``cgx.py`` and ``qsgd.py``, on the shared ``plumbing.py``
(backend choice, argument checks, output buffers). The kernels themselves are in
``reference.py`` (NumPy), ``cpu/`` and ``cuda.py`` (Numba).

Backends (``backend=``): ``"auto"`` (CUDA kernels for CUDA tensors, CPU kernels otherwise),
``"cpu"`` (Numba ``njit(parallel=True)``), ``"cuda"`` (Numba ``cuda.jit``; CUDA tensors, or
CPU tensors under ``NUMBA_ENABLE_CUDASIM=1``) and ``"reference"`` (NumPy, ``reference.py``).
Numba is imported, and kernels compiled, on first use only; the CPU kernels are also cached
on disk (Numba's ``cache=True``, see ``cpu/``), so later processes load them instead of
compiling them again.

Conventions:

* Inputs may be float32, float16 or bfloat16, on CPU or CUDA, contiguous or not.
  Kernels read float32: fp16/bf16 inputs, and non-contiguous ones, are first made
  contiguous float32 by one documented copy (``x.to(torch.float32).contiguous()``, exact);
  a contiguous float32 tensor is used in place. ``absmax`` reads fp16/bf16 bits directly.
* Outputs are new tensors on the input's device, written in place by the kernels, or the
  caller's ``out=`` tensor (quantize/dequantize/fake-quantize/float casts/APS): it must be
  contiguous with the result's exact shape, dtype and device (else QSyncError), and is
  overwritten. Reusing ``out=`` skips the allocation and its first-touch page faults, which
  on CPU cost as much as the kernel itself for large tensors. New CPU outputs of 4 MiB or
  more are advised as transparent huge pages (``madvise(MADV_HUGEPAGE)`` on that buffer only,
  Linux; a no-op elsewhere), which makes first touch much cheaper.
* CPU threads: Numba's default threading layer and thread count (``NUMBA_NUM_THREADS``) are
  used as is; nothing here changes process-wide settings. torch and Numba each run an OpenMP
  pool (two libgomp copies). Keep libgomp's default wait policy (a bounded spin) when mixing
  both in a hot loop: ``OMP_WAIT_POLICY=PASSIVE`` makes every parallel region wake sleeping
  threads, which adds a wake-up latency to every kernel call and slows small torch ops
  (matmuls included).
* NaN/Inf: ``absmax`` propagates NaN like ``torch.amax``; the float-format casts handle them
  exactly like torch's casts; every integer quantizer (int8, Global-QSGD, CGX, QSGD) raises
  QSyncError, found by the abs-max (or norm) pass it needs anyway.
* Stochastic rounding draws ``u`` from a counter hash of (seed, element index), so CPU,
  CUDA and reference agree bit for bit and reruns are reproducible.
"""

from .aps import APS_ZERO_EXPONENT, aps_dequantize, aps_exponent, aps_quantize, aps_shift
from .cgx import CGXPacked, cgx_decode, cgx_decode_mean, cgx_encode
from .floats import (FloatCodes, float_decode, float_decode_sum, float_encode, float_quantize,
                     float_round)
from .global_qsgd import global_qsgd_decode, global_qsgd_encode
from .int8 import (FakeQuantResult, Int8Tensor, dequantize_int8, dequantize_int8_sum,
                   fake_quantize_int8, quantize_int8)
from .plumbing import BACKENDS
from .qsgd import QSGDCodes, qsgd_decode, qsgd_decode_sum, qsgd_encode
from .reductions import absmax, l2norm

__all__ = [
    "APS_ZERO_EXPONENT",
    "BACKENDS",
    "CGXPacked",
    "FakeQuantResult",
    "FloatCodes",
    "Int8Tensor",
    "QSGDCodes",
    "absmax",
    "aps_dequantize",
    "aps_exponent",
    "aps_quantize",
    "aps_shift",
    "cgx_decode",
    "cgx_decode_mean",
    "cgx_encode",
    "dequantize_int8",
    "dequantize_int8_sum",
    "fake_quantize_int8",
    "float_decode",
    "float_decode_sum",
    "float_encode",
    "float_quantize",
    "float_round",
    "global_qsgd_decode",
    "global_qsgd_encode",
    "l2norm",
    "qsgd_decode",
    "qsgd_decode_sum",
    "qsgd_encode",
    "quantize_int8",
]
