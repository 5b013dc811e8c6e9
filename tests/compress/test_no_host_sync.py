"""No host synchronisation inside encode, reduce or the hook on CUDA tensors (issue 36).

On CUDA tensors every method takes its device path (``codec.on_device``): the scales,
norms, maxima and non-finite marks stay device tensors that feed the next kernel or torch op,
and a marked bucket raises nothing inside the call (``CompressionState.check_finite`` reads
the marks once per step). Without a GPU, these tests run that same path on CPU tensors
(``codec.DEVICE_PATH_ON_CPU``; its kernels are the CUDA ones, in Numba's simulator) under a
``TorchDispatchMode`` that records every aten op by which a tensor's value reaches the host
(``aten._local_scalar_dense``, what ``.item()``, ``float()``, ``int()`` dispatch to;
``aten.is_nonzero``, what ``bool()`` does; ``torch.equal``, ``nonzero``, a boolean-mask
index, ...), plus ``Tensor.tolist`` and ``Tensor.cpu`` calls, and check that it records
nothing, and that the device path's means and errors are the CPU path's bit for bit. The
CPU path (the code every CUDA call ran before) reads values on every method, and the
recorder sees those reads: the check can fail.

What these tests cannot show: a copy to the host that is no aten op on CPU tensors
(``.numpy()``, which the simulator's launches use by design, ``.to("cpu")``), a CUDA stream
or Numba synchronisation, and a division by a Python number (CUDA multiplies by its
reciprocal, the CPU divides: the same bits here). ``tests/compress/test_hook_cuda.py`` runs
the same calls and a hooked DDP step on a GPU under
``torch.cuda.set_sync_debug_mode("error")``, which catches those.
"""

import contextlib
import traceback

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from qsync_lab.compress import codec
from qsync_lab.compress.codec import NonFiniteGradient, Workspace
from qsync_lab.compress.comm import Comm
from qsync_lab.compress.hook import CompressionState, StandaloneBucket, compression_hook
from qsync_lab.compress.methods import method_module
from qsync_lab.compress.spec import CompressionSpec
from tests.compress.ranks import run_ranks

N = 320  # small: the device path's kernels run in Numba's CUDA simulator
SEGMENTS = [(0, 100), (100, 220)]
WORLD = 2
SPECS = ["fp16", "bf16", "global_qsgd:8", "global_qsgd:16",
         {"method": "global_qsgd", "dithering": "exponential"}, "aps:fp8_e5m2", "aps:fp8_e4m3",
         "cgx:4", {"method": "cgx", "bits": 3, "group_size": 100}, "qsgd:8"]
BF16_TOO = ("fp16", "global_qsgd", "aps", "cgx")  # methods also checked on a bf16 bucket
# a NaN on one rank: the simulator cannot run the int8 quantizer on NaN (Python's floor of
# NaN raises, where a GPU writes some code), so global_qsgd:8/16 and qsgd are left to the GPU
NAN_SPECS = ["fp16", "bf16", {"method": "global_qsgd", "dithering": "exponential"},
             "aps:fp8_e4m3", "cgx:4"]
HOOK_SPECS = ["global_qsgd:8", "qsgd:8", "aps:fp8_e4m3,error_feedback=true",
              "cgx:4,error_feedback=true,group_size=64", "fp16,error_feedback=true"]
NAN_HOOK = ("aps", "cgx", "fp16")  # the methods of HOOK_SPECS the simulator runs on a NaN

aten = torch.ops.aten
_READS = {aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.allclose, aten.item,
          aten.nonzero, aten.masked_select, aten._unique2, aten.unique_consecutive,
          aten.unique_dim, aten.repeat_interleave}


def _where() -> str:
    """The innermost project frame that led here."""
    frames = [f for f in traceback.extract_stack()[:-2]
              if ("qsync_lab" in f.filename or "/kernels/" in f.filename)
              and "python_dispatch" not in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


class HostReads(TorchDispatchMode):
    """Records each aten op that reads a tensor's value on the host (on CUDA: a sync)."""

    def __init__(self, reads: list) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in _READS or (packet is aten.index and any(
                i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])):
            self.reads.append(f"{func} at {_where()}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def recording(reads: list):
    """:class:`HostReads` on this thread, and ``Tensor.tolist``/``Tensor.cpu`` calls on any
    (a copy to the host that no aten op shows on CPU tensors)."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu")}

    def spy(name):
        def call(self, *args, **kwargs):
            reads.append(f"Tensor.{name} at {_where()}")
            return originals[name](self, *args, **kwargs)
        return call

    for name in originals:
        setattr(torch.Tensor, name, spy(name))
    try:
        with HostReads(reads):
            yield reads
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


@contextlib.contextmanager
def device_path(on: bool):
    """The methods' device path on CPU tensors (``on``), or their CPU path. (Code without a
    device path runs the one path it has, and its host reads are recorded.)"""
    before = getattr(codec, "DEVICE_PATH_ON_CPU", False)
    codec.DEVICE_PATH_ON_CPU = on
    try:
        yield
    finally:
        codec.DEVICE_PATH_ON_CPU = before


def gradient(rank: int, seed: int = 0) -> torch.Tensor:
    g = torch.randn(N, generator=torch.Generator().manual_seed(100 * seed + rank))
    g[:100] *= 1e-3
    return g


def _encode_reduce(module, spec, comm, x, on):
    """Encode (with the error) and reduce into a bucket of x's dtype through a workspace,
    then again without either; what was read on the host."""
    reads = []
    with device_path(on), recording(reads):
        workspace = Workspace()
        encoded = module.encode(x.clone(), SEGMENTS, spec, comm, seed=5, error=True,
                                workspace=workspace)
        error = None if encoded.error is None else encoded.error.clone()
        mean = module.reduce(encoded, spec, comm, out=torch.empty_like(x),
                             workspace=workspace).clone()
        plain = module.reduce(module.encode(x.clone(), SEGMENTS, spec, comm, seed=6), spec,
                              comm).clone()
    return (mean, error, plain), reads


def _methods(rank, world):
    """Per spec and dtype: the CPU path's and the device path's results and host reads."""
    comm, out = Comm(None), []
    for spec in map(CompressionSpec.parse, SPECS):
        module = method_module(spec)
        dtypes = (torch.float32, torch.bfloat16) if spec.method in BF16_TOO else (torch.float32,)
        for dtype in dtypes:
            x = gradient(rank).to(dtype)
            cpu, cpu_reads = _encode_reduce(module, spec, comm, x, False)
            dev, dev_reads = _encode_reduce(module, spec, comm, x, True)
            same = [a is None and b is None or (a is not None and b is not None
                                                and torch.equal(a, b))
                    for a, b in zip(cpu, dev)]
            out.append((spec.key, str(dtype), same, cpu[1] is not None, len(cpu_reads),
                        dev_reads))
    return out


@pytest.fixture(scope="module")
def method_results():
    return run_ranks(_methods, WORLD)


def test_the_recorder_sees_the_cpu_paths_host_reads(method_results):
    """Every method's CPU path (what CUDA tensors ran before) reads values on the host (at
    least its non-finite check): the recorder is not blind to them."""
    for rows in method_results:
        for key, dtype, *_, cpu_reads, _ in rows:
            assert cpu_reads > 0, (key, dtype)


def test_encode_and_reduce_read_nothing_on_the_host_on_the_device_path(method_results):
    for rows in method_results:
        for key, dtype, *_, dev_reads in rows:
            assert dev_reads == [], (key, dtype, dev_reads)


def test_the_device_path_gives_the_cpu_paths_means_and_errors_bit_for_bit(method_results):
    for rows in method_results:
        for key, dtype, same, has_error, *_ in rows:
            assert same == [True, True, True], (key, dtype, same)
            assert has_error, key


def _nonfinite(rank, world):
    """A NaN on the last rank, device path: whether the mean is finite, the workspace's marks
    and what was read on the host."""
    comm, out = Comm(None), []
    for spec in map(CompressionSpec.parse, NAN_SPECS):
        module = method_module(spec)
        x = gradient(rank)
        if rank == world - 1:
            x[150] = float("nan")
        reads, workspace = [], Workspace()
        with device_path(True), recording(reads):
            encoded = module.encode(x, SEGMENTS, spec, comm, seed=1, error=True,
                                    workspace=workspace)
            mean = module.reduce(encoded, spec, comm, out=torch.empty(N), workspace=workspace)
        marks = {what: bool(mark) for what, mark in workspace.pop_nonfinite().items()}
        out.append((spec.key, bool(torch.isfinite(mean).all()), marks, reads))
    return out


def test_a_nan_on_one_rank_marks_the_bucket_on_every_rank_without_a_host_read():
    for rows in run_ranks(_nonfinite, WORLD):
        for key, finite, marks, reads in rows:
            assert reads == [], (key, reads)
            assert not finite, key  # nothing averaged silently: the mean is not finite
            assert marks and all(marks.values()), (key, marks)


def _hook(rank, world):
    """Per spec, on the CPU path and the device path: the hook's means of two buckets (the
    second with the first's residual), the telemetry's relative error and the host reads in
    the sender thread; on the device path, then a bucket with a NaN on the last rank."""
    run = CompressionState._run

    def recorded_run(self):  # the sender thread, where encode and reduce run
        with HostReads(self.reads):
            run(self)

    CompressionState._run = recorded_run
    model = nn.Module()
    model.weight = nn.Parameter(torch.empty(20, N // 20))
    out = []
    for text in HOOK_SPECS:
        result = {"nan": None}
        method = CompressionSpec.parse(text).method
        for on in (False, True):
            state = CompressionState(model, f"{text},min_numel=0", seed=5, error_every=1)
            state.reads = []
            with device_path(on), recording(state.reads):
                means = [compression_hook(state, StandaloneBucket(
                    model.weight, gradient(rank, seed))).wait().clone() for seed in (1, 2)]
            telemetry = state.telemetry()  # a lazy read of the device path's norms
            getattr(state, "check_finite", lambda: None)()  # finite: nothing raised
            result[on] = (means, telemetry[method], list(state.reads))
            if on and method in NAN_HOOK:
                result["nan"] = _hook_nan(state, model, rank, world)
            state.close()
        (cpu_means, cpu_stats, cpu_reads), (dev_means, dev_stats, dev_reads) = \
            result[False], result[True]
        out.append((text, [torch.equal(a, b) for a, b in zip(cpu_means, dev_means)],
                    cpu_stats["relative_error"], dev_stats["relative_error"], len(cpu_reads),
                    dev_reads, result["nan"]))
    CompressionState._run = run
    return out


def _hook_nan(state, model, rank, world):
    """A NaN bucket through the hook's device path: (no exception from the hook, the mean
    not finite, the residuals kept, check_finite raising, host reads, the next bucket
    finite)."""
    kept = {name: r.clone() for name, r in state.residuals.items()}
    g = gradient(rank, 3)
    if rank == world - 1:
        g[5] = float("nan")
    reads = state.reads  # the list the sender thread's recorder appends to
    reads.clear()
    with device_path(True), recording(reads):
        mean = compression_hook(state, StandaloneBucket(model.weight, g)).wait()
    residuals_kept = all(torch.equal(kept[name], r) for name, r in state.residuals.items())
    try:
        state.check_finite()
        raised = None
    except NonFiniteGradient as err:
        raised = str(err)
    with device_path(True):
        after = compression_hook(state, StandaloneBucket(model.weight, gradient(rank, 4))).wait()
    return (bool(torch.isfinite(mean).all()), residuals_kept, raised, list(reads),
            bool(torch.isfinite(after).all()))


@pytest.fixture(scope="module")
def hook_results():
    return run_ranks(_hook, WORLD)


def test_the_hook_reads_nothing_on_the_host_on_the_device_path(hook_results):
    for rows in hook_results:
        for text, _, _, _, cpu_reads, dev_reads, _ in rows:
            assert cpu_reads > 0, text  # the CPU path reads (and the recorder sees it)
            assert dev_reads == [], (text, dev_reads)


def test_the_hooks_device_path_gives_the_cpu_paths_means_and_telemetry(hook_results):
    for rows in hook_results:
        for text, same, cpu_error, dev_error, *_ in rows:
            assert same == [True, True], text
            # the float64 sums of squares run in another order on the simulator
            assert dev_error == pytest.approx(cpu_error, rel=1e-9) and cpu_error > 0, text


def test_a_nan_bucket_on_the_device_path_is_raised_by_check_finite_on_every_rank(hook_results):
    """The hook raises nothing and reads nothing; the mean is not finite, the error-feedback
    residuals keep their values, check_finite raises NonFiniteGradient on every rank, and
    the next bucket is reduced as usual."""
    checked = set()
    for rows in hook_results:
        for text, *_, nan in rows:
            if nan is None:  # int8 quantizers: on the GPU only (see NAN_SPECS)
                continue
            checked.add(text)
            finite, residuals_kept, raised, reads, next_finite = nan
            assert reads == [], (text, reads)
            assert not finite and residuals_kept and next_finite, text
            assert raised is not None and "NaN or Inf" in raised, text
    assert len(checked) == len(NAN_HOOK)
