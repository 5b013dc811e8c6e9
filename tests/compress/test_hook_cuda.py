"""The comm hook on CUDA buckets (needs a GPU: run with ``--gpu``): every method gives the
CPU path's mean bit for bit, and DDP trains with it on gloo and NCCL ranks.

All ranks share the machine's GPUs (``cuda:rank % count``): NCCL needs one GPU per rank,
so its test runs one rank when the machine has one GPU.
"""

import contextlib

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from qsync_lab.compress import register_compression
from qsync_lab.compress.hook import CompressionState, StandaloneBucket, compression_hook
from tests.compress.ranks import run_ranks

pytestmark = pytest.mark.gpu

SPECS = ("fp16", "bf16", "global_qsgd:8", "global_qsgd:8,dithering=exponential",
         "aps:fp8_e5m2", "aps:fp8_e4m3", "cgx:8", "cgx:4", "cgx:4,error_feedback=true",
         "qsgd:8")


def _device(rank: int) -> torch.device:
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _means_on_both_devices(rank, world, dtype):
    """Per spec, the hook's output for two calls on this rank's gradient: CPU, then CUDA."""
    device = _device(rank)
    model = nn.Module()
    model.weight = nn.Parameter(torch.empty(64, 300))
    gradient = torch.randn(model.weight.numel(),
                           generator=torch.Generator().manual_seed(rank)).to(dtype)
    out = {}
    for text in SPECS:
        per_device = []
        for where in ("cpu", device):
            state = CompressionState(model, text, seed=5, telemetry=False)
            calls = []
            for _ in range(2):  # the second call adds the first one's error feedback
                bucket = StandaloneBucket(model.weight, gradient.to(where, copy=True))
                calls.append(compression_hook(state, bucket).wait().cpu())
            state.close()
            per_device.append(calls)
        out[text] = per_device
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [1, 2])
def test_every_method_gives_the_cpu_mean_bit_for_bit(world, dtype):
    for rank_out in run_ranks(_means_on_both_devices, world, dtype):
        for text, (cpu, cuda) in rank_out.items():
            for call, (a, b) in enumerate(zip(cpu, cuda)):
                assert torch.equal(a, b), (text, call)
                assert not torch.equal(a, torch.zeros_like(a)), text


def _train(rank, world, spec):
    device = _device(rank)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4)).to(device),
                device_ids=[device], bucket_cap_mb=0.05)
    state = register_compression(model, {"method": spec.split(":")[0],
                                         "bits": int(spec.split(":")[1]), "min_numel": 0,
                                         "compress_1d": True}, seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    target = torch.randn(64, 4, generator=torch.Generator().manual_seed(9)).to(device)
    losses = []
    for _ in range(30):  # DDP rebuilds its buckets after the first step
        x = torch.randn(32, 64, generator=generator).to(device)
        optimizer.zero_grad()
        loss = (model(x) - x @ target).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    telemetry = state.telemetry()
    state.close()
    return [p.detach().cpu() for p in model.parameters()], losses, sorted(telemetry)


@pytest.mark.parametrize("spec", ["global_qsgd:8", "cgx:4"])
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_ddp_trains_on_cuda(backend, spec):
    world = 2 if backend == "gloo" else min(2, torch.cuda.device_count())
    results = run_ranks(_train, world, spec, backend=backend)
    params, losses, methods = results[0]
    for other, _, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params, other))  # ranks agree
    assert losses[-1] < 0.5 * losses[0]
    assert methods == [spec.split(":")[0]]


def _resumed_from_cpu_residuals(rank, world):
    """An error-feedback hook's second call on a CUDA bucket: straight on, and after its
    state went through a checkpoint (residuals as CPU tensors) into a new state."""
    device = _device(rank)
    model = nn.Module()
    model.weight = nn.Parameter(torch.empty(64, 300))
    gradients = [torch.randn(model.weight.numel(), generator=torch.Generator().manual_seed(s),
                             device="cpu").to(device) for s in (1, 2)]
    spec = "cgx:4,error_feedback=true"

    def call(state, gradient):
        bucket = StandaloneBucket(model.weight, gradient.clone())
        return compression_hook(state, bucket).wait().cpu()

    straight = CompressionState(model, spec, seed=5, telemetry=False)
    call(straight, gradients[0])
    saved = straight.state_dict()
    saved["residuals"] = {name: r.cpu() for name, r in saved["residuals"].items()}
    resumed = CompressionState(model, spec, seed=5, telemetry=False)
    resumed.load_state_dict(saved)
    out = torch.equal(call(straight, gradients[1]), call(resumed, gradients[1]))
    for state in (straight, resumed):
        state.close()
    return out, resumed.failure is None


def test_a_resumed_error_feedback_hook_takes_its_checkpoints_cpu_residuals():
    assert run_ranks(_resumed_from_cpu_residuals, 1) == [(True, True)]


def _telemetry_and_stream_time(rank, world):
    """Per spec, one 25 MiB bucket's hook call after three warm-up calls: the telemetry's
    encode + decode ms, and the ms the stream spent from the call to its completed future."""
    device = _device(rank)
    model = nn.Module()
    model.weight = nn.Parameter(torch.empty(2560, 2560))
    gradient = torch.randn(model.weight.numel(),
                           generator=torch.Generator().manual_seed(rank)).to(device)
    buffer = torch.empty_like(gradient)
    out = {}
    for text in ("fp16", "global_qsgd:8", "cgx:4"):
        state = CompressionState(model, text, telemetry=False)
        for _ in range(4):
            buffer.copy_(gradient)
            state.telemetry()  # read and reset: the last call's parts only
            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            begin.record()
            compression_hook(state, StandaloneBucket(model.weight, buffer)).wait()
            end.record()
        stats = state.telemetry()[text.split(":")[0]]
        out[text] = (stats["encode_ms"] + stats["decode_ms"], stats["comm_ms"],
                     begin.elapsed_time(end))
        state.close()
    return out


def test_the_telemetry_times_the_hooks_parts_on_the_stream():
    """CUDA buckets are timed with events on their stream: the encode and decode of one
    call lie within the stream's time for the whole call (one rank: no collective)."""
    (rows,) = run_ranks(_telemetry_and_stream_time, 1)
    for text, (parts_ms, comm_ms, call_ms) in rows.items():
        assert 0 < parts_ms <= call_ms * 1.001 and comm_ms == 0, (text, parts_ms, call_ms)


# ------------------------------------------------ no host synchronisation (issue 36, item 2)
SYNC_SPECS = ("fp16", "bf16", "global_qsgd:8", "global_qsgd:16",
              "global_qsgd:8,dithering=exponential", "aps:fp8_e5m2", "aps:fp8_e4m3", "cgx:4",
              "cgx:3,group_size=100", "qsgd:8")
SYNC_SEGMENTS = [(0, 3000), (3000, 5192)]


@contextlib.contextmanager
def _syncs_raise():
    """Every synchronising CUDA call raises: torch's (``.item()``, ``float()``, ``bool()``,
    copies to or from pageable host memory, stream and device synchronisation) through
    ``set_sync_debug_mode("error")``, Numba's (a copy to or from the host, a synchronise)
    through patches."""
    from numba import cuda as ncuda
    from numba.cuda.cudadrv import devicearray, driver

    def refuse(*args, **kwargs):
        raise RuntimeError("a Numba host synchronisation inside a no-sync region")

    patched = [(devicearray.DeviceNDArrayBase, "copy_to_host"), (driver.Stream, "synchronize"),
               (ncuda, "synchronize"), (ncuda, "to_device")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]
    for owner, name in patched:
        setattr(owner, name, refuse)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
        for owner, name, value in saved:
            setattr(owner, name, value)


def _inputs(device, nan_rank, rank):
    """Per spec a float32 and a bf16 bucket, and a float32 one with a NaN on rank
    ``nan_rank`` (-1: none), made before any no-sync region."""
    out, numel = [], sum(n for _, n in SYNC_SEGMENTS)
    for text in SYNC_SPECS:
        for dtype, nan in ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True)):
            x = torch.linspace(-3, 2, numel, device=device).to(dtype)
            if nan and nan_rank == rank:
                x[numel * 3 // 4] = float("nan")
            out.append((text, dtype, nan, x, torch.empty_like(x)))
    return out


def _every_method_once(comm, inputs, workspace):
    """Each input's encode (with its error) and reduce, into its bucket through the workspace
    and again without either: the means."""
    from qsync_lab.compress.methods import method_module
    from qsync_lab.compress.spec import CompressionSpec

    out = []
    for text, dtype, nan, x, bucket in inputs:
        spec = CompressionSpec.parse(text)
        module = method_module(spec)
        encoded = module.encode(x, SYNC_SEGMENTS, spec, comm, seed=7, error=True,
                                workspace=workspace)
        mean = module.reduce(encoded, spec, comm, out=bucket, workspace=workspace)
        plain = module.reduce(module.encode(x, SYNC_SEGMENTS, spec, comm, seed=8), spec, comm)
        out.append((text, str(dtype), nan, mean, plain))
    return out


def _no_sync(rank, world):
    from qsync_lab.compress.codec import Workspace
    from qsync_lab.compress.comm import Comm

    device = _device(rank)
    comm, workspace = Comm(None), Workspace()
    # kernels compiled, decode tables built, the caching allocator warm: outside the check
    expected = _every_method_once(comm, _inputs(device, -1, rank), workspace)
    workspace.pop_nonfinite()
    inputs = _inputs(device, 0, rank)
    torch.cuda.synchronize()
    with _syncs_raise():
        got = _every_method_once(comm, inputs, workspace)
    torch.cuda.synchronize()
    marks = workspace.pop_nonfinite()
    assert marks and all(bool(mark) for mark in marks.values()), marks
    for (text, dtype, nan, mean, plain), (_, _, _, want, want_plain) in zip(got, expected):
        if nan:  # nothing averaged silently: the marked bucket's mean is not finite
            assert not bool(torch.isfinite(mean).all()), (text, dtype)
        else:  # and the others are what they were with syncs allowed
            assert torch.equal(mean, want) and torch.equal(plain, want_plain), (text, dtype)

    # one hooked DDP step: forward, backward through the hook, optimizer step
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(),
                              nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).to(device),
                bucket_cap_mb=0.02)
    state = register_compression(model, {"0.weight": "cgx:4,error_feedback=true",
                                         "2.weight": "aps:fp8_e4m3,error_feedback=true",
                                         "4.weight": "global_qsgd:8",
                                         "6.weight": "fp16,min_numel=0", "6.bias": None,
                                         "_default": "qsgd:8,min_numel=0,compress_1d=true"},
                                 seed=1, error_every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randn(32, 64, generator=generator).to(device) for _ in range(13)]
    target = torch.randn(64, 4, generator=torch.Generator().manual_seed(9)).to(device)
    losses = []

    def step(x):
        optimizer.zero_grad()
        loss = (model(x) - x @ target).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())

    # past DDP's bucket rebuild (after the first step) and its timed first 10 iterations
    for x in batches[:12]:
        step(x)
    state.check_finite()
    torch.cuda.synchronize()
    with _syncs_raise():
        step(batches[12])
    torch.cuda.synchronize()
    state.check_finite()  # outside the hook: one read per step
    telemetry = state.telemetry()
    state.close()
    assert state.failure is None
    assert sorted(telemetry) == ["aps", "cgx", "fp16", "fp32", "global_qsgd", "qsgd"], telemetry
    assert all(stats["relative_error"] is not None for method, stats in telemetry.items()
               if method != "fp32"), telemetry
    assert all(bool(torch.isfinite(loss)) for loss in losses)
    return True


def test_no_host_sync_in_encode_reduce_or_a_hooked_ddp_step():
    """Issue 36: on a GPU, every method's encode and reduce (a finite bucket and one with a
    NaN, which marks it on the device and raises nothing) and one whole hooked DDP step run
    under ``torch.cuda.set_sync_debug_mode("error")``, Numba's host copies refused too; the
    results equal those of the same calls with syncs allowed. One NCCL rank (gloo where
    NCCL is missing)."""
    import torch.distributed as dist

    backend = "nccl" if dist.is_nccl_available() else "gloo"
    assert run_ranks(_no_sync, 1, backend=backend) == [True]
