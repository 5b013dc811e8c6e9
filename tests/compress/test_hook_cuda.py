"""The comm hook on CUDA buckets (needs a GPU: run with ``--gpu``): every method gives the
CPU path's mean bit for bit, and DDP trains with it on gloo and NCCL ranks.

All ranks share the machine's GPUs (``cuda:rank % count``): NCCL needs one GPU per rank,
so its test runs one rank when the machine has one GPU.
"""

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
