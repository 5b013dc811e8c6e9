"""Forward+backward latency of the low-precision operators beside the plain fp32 module.

Run: ``.venv/bin/python benchmarks/qops.py [--device cpu|cuda] [--repeats 10] [--out FILE]``
(add ``--ops matmul linear`` to run only those op kinds).

For each op kind at a BERT-base or ResNet shape and each precision, the op (a fresh copy of
the fp32 module with ``apply_plan_`` applied) runs forward and backward (gradients of the
input and the parameters); the table gives the median over ``--repeats`` runs after
warm-up and the ratio to the plain fp32 module. The variants of one op run interleaved
(each repeat runs every precision once), so load from other processes hits them alike. On
the CPU every low precision is the exact fp32 emulation, so the ratio is the emulation
overhead; on a GPU the native kernels run.

The OpenMP wait policy (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) is taken from the environment
and printed with the table. Leave it at libgomp's default: ``OMP_WAIT_POLICY=PASSIVE`` puts
torch's and Numba's workers to sleep after every op, and waking them costs 50-150 µs per
emulation kernel on a 2-core VM (and slows fp32 bmm up to 1.75x).
"""

import argparse
import copy
import os
import statistics
import time
from collections.abc import Sequence

import pandas as pd
import torch
from torch import nn

from qsync_lab.models import MatMul
from qsync_lab.quant import apply_plan_

PRECISIONS = {
    "tf32": "tf32",
    "fp16": "fp16",
    "bf16": "bf16",
    "int8": "int8",
    "int8 channel": {"forward": "int8", "granularity": "channel"},
    "int8 stochastic": {"forward": "int8", "rounding": "stochastic"},
    "fp8_e4m3": "fp8_e4m3",
}
WARMUP = 3
OPS = ("linear", "conv2d", "matmul", "embedding")


def _cases(device):
    """(op, shape, module, inputs) at BERT-base (batch 8, seq 128) and ResNet shapes."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=g).to(device)

    tokens = torch.randint(0, 30522, (8, 128), generator=g).to(device)
    return [
        ("linear", "8x128x768 -> 768", nn.Linear(768, 768), (randn(8, 128, 768),)),
        ("linear", "8x128x768 -> 3072", nn.Linear(768, 3072), (randn(8, 128, 768),)),
        ("linear", "8x128x3072 -> 768", nn.Linear(3072, 768), (randn(8, 128, 3072),)),
        ("conv2d", "8x64x56x56, 3x3 -> 64", nn.Conv2d(64, 64, 3, padding=1, bias=False),
         (randn(8, 64, 56, 56),)),
        ("conv2d", "8x256x14x14, 3x3 -> 256", nn.Conv2d(256, 256, 3, padding=1, bias=False),
         (randn(8, 256, 14, 14),)),
        ("matmul", "8x12x128x64 @ 64x128", MatMul(),
         (randn(8, 12, 128, 64), randn(8, 12, 64, 128))),
        ("embedding", "30522x768 [8x128]", nn.Embedding(30522, 768), (tokens,)),
    ]


def _step(module, inputs):
    """One forward+backward of ``module`` (input and parameter gradients)."""
    inputs = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
    grad = torch.randn_like(module(*inputs))
    return lambda: module(*inputs).backward(grad)


def _interleaved_ms(steps, repeats, sync):
    """Median ms of each step, running them round-robin after warm-up."""
    for step in steps:
        for _ in range(WARMUP):
            step()
    sync()
    times = [[] for _ in steps]
    for _ in range(repeats):
        for step, samples in zip(steps, times):
            start = time.perf_counter()
            step()
            sync()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) * 1e3 for samples in times]


def run(device: str, repeats: int, ops: Sequence[str] = OPS) -> pd.DataFrame:
    """One row per (op, shape, precision) of the ``ops`` kinds: median fwd+bwd ms and the
    ratio to fp32."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for op, shape, module, inputs in _cases(device):
        if op not in ops:
            continue
        module = module.to(device)
        labels, steps = ["fp32 (plain)"], [_step(module, inputs)]
        for label, value in PRECISIONS.items():
            if op == "embedding" and label == "tf32":
                continue
            low = copy.deepcopy(module)
            apply_plan_(low, {"": value})
            labels.append(label)
            steps.append(_step(low, inputs))
        times = _interleaved_ms(steps, repeats, sync)
        rows += [(op, shape, label, ms, ms / times[0]) for label, ms in zip(labels, times)]
    return pd.DataFrame(rows, columns=["op", "shape", "precision", "fwd+bwd ms", "x fp32"])


def _wait_policy() -> str:
    """The OpenMP wait settings in effect, as "NAME=value" (or libgomp's default)."""
    names = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    set_ = [f"{n}={os.environ[n]}" for n in names if os.environ.get(n)]
    return ", ".join(set_) or "default OpenMP wait policy"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--ops", nargs="+", default=OPS, choices=OPS, help="op kinds to run")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU")
    where = torch.cuda.get_device_name() if args.device == "cuda" else (
        f"CPU, {torch.get_num_threads()} torch threads, " + _wait_policy())
    table = run(args.device, args.repeats, args.ops)
    text = (f"torch {torch.__version__}, {where}; median of {args.repeats} after {WARMUP} "
            f"warm-up runs\n{table.to_string(index=False, float_format=lambda v: f'{v:.2f}')}\n")
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
