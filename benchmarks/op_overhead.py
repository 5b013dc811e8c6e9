"""Host cost of one low-precision op: forward+backward at shapes too small for the device
to matter, beside plain torch (eager fp32, TF32, autocast).

Run: ``.venv/bin/python benchmarks/op_overhead.py [--device cpu|cuda] [--repeats 60]
[--out FILE]``.

A training step on a fast GPU is often bound by its host: each op costs the Python and
dispatch time of issuing it, whatever its size. This script measures that cost per op kind
(a linear, a 3x3 convolution, a batched matmul, all tiny) for every way an op can run:

* ``torch:*``: the plain module, eager fp32 (TF32 off), TF32 on, or under
  ``torch.autocast`` bf16 / fp16;
* ``plan:*``: the module with ``apply_plan_`` applied, natively (on the CPU through
  ``execution("native")``, the path CUDA operands take): ``tf32 kept on`` is a tf32 op in
  a rank that keeps TF32 on (no fp32 GEMM), ``tf32 switched`` one in a rank with fp32
  GEMMs (the switches flipped around its forward and, by node hooks, its backward),
  ``tf32 function`` the same op through the autograd function that split-precision ops
  (e.g. tf32 forward, fp32 backward) use.

Each variant runs ``--repeats`` samples of :data:`CALLS` back-to-back calls, round-robin
after warm-up, each round starting one variant later (the variants share the machine's
drift, and none always runs first); the table gives the median µs of one forward+backward, the ratio to
eager fp32 and the aten calls one forward+backward dispatches (on CUDA about its kernel
launches). fp8 runs only on CUDA (torch's CPU ``_scaled_mm`` is a slow reference).
"""

import argparse
import contextlib
import copy
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from qsync_lab.models import MatMul
from qsync_lab.policy import OpPrecision
from qsync_lab.precision import Precision
from qsync_lab.quant import apply_plan_
from qsync_lab.quant.gemm import LinearKernel
from qsync_lab.quant.native import _NativeFloat, execution, set_tf32
from reporting import finish_report, load_line

WARMUP = 20
CALLS = 10  #: forward+backward calls per sample, back to back
PLANS = ("fp32", "bf16", "fp16", "int8", "fp8_e4m3")


def _cases():
    """(op, shape, module, inputs): tiny shapes, so the host's time is the op's."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=g)

    return [("linear", "32x64 -> 64", nn.Linear(64, 64), (randn(32, 64),)),
            ("conv2d", "2x8x8x8, 3x3 -> 8", nn.Conv2d(8, 8, 3, padding=1), (randn(2, 8, 8, 8),)),
            ("matmul", "4x16x16 @ 4x16x16", MatMul(), (randn(4, 16, 16), randn(4, 16, 16)))]


class _FunctionLinear(nn.Linear):
    """A linear computed by the native float autograd function, tf32 in both passes."""

    def forward(self, x):
        return _NativeFloat.apply(x, self.weight, self.bias, LinearKernel(), Precision.TF32,
                                  Precision.TF32)


class _CountCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _variants(op: str, module: nn.Module, device: str):
    """(label, module, TF32 switches on, autocast dtype or None) of every way to run it."""
    yield "torch: eager fp32", module, False, None
    yield "torch: TF32", module, True, None
    yield "torch: autocast bf16", module, False, torch.bfloat16
    yield "torch: autocast fp16", module, False, torch.float16
    for label, tf32_on in (("tf32 kept on", True), ("tf32 switched", False)):
        planned = copy.deepcopy(module)
        apply_plan_(planned, {"": "tf32"})
        yield f"plan: {label}", planned, tf32_on, None
    if op == "linear":
        function = _FunctionLinear(64, 64).to(device)
        function.load_state_dict(module.state_dict())
        yield "plan: tf32 function", function, False, None
    for precision in PLANS:
        if precision == "fp8_e4m3" and (device == "cpu" or op != "linear"):
            continue
        if precision == "int8" and op != "linear":
            continue  # int8 convolutions and batched matmuls are emulated
        planned = copy.deepcopy(module)
        apply_plan_(planned, {"": OpPrecision.parse(precision)})
        yield f"plan: {precision}", planned, False, None


def _step(module: nn.Module, inputs: tuple, tf32_on: bool, autocast, device: str):
    """One forward+backward of ``module`` under its switches (input and parameter grads)."""
    inputs = [t.clone().requires_grad_() for t in inputs]

    def step():
        set_tf32(tf32_on)
        with torch.autocast(device, autocast) if autocast else contextlib.nullcontext():
            out = module(*inputs)
        out.float().sum().backward()
    return step


def run(device: str, repeats: int) -> pd.DataFrame:
    """One row per (op, variant): median µs of a forward+backward, x eager fp32, aten calls."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    rows = []
    for op, shape, module, inputs in _cases():
        module, inputs = module.to(device), tuple(t.to(device) for t in inputs)
        variants = list(_variants(op, module, device))
        steps = [_step(m, inputs, on, cast, device) for _, m, on, cast in variants]
        calls = []
        for step in steps:
            for _ in range(WARMUP):
                step()
            with _CountCalls() as counted:
                step()
            calls.append(counted.count)
        samples = [[] for _ in steps]
        for r in range(repeats):
            for i in range(len(steps)):  # each round starts one later: no variant runs first
                i = (i + r) % len(steps)
                sync()
                begin = time.perf_counter()
                for _ in range(CALLS):
                    steps[i]()
                sync()
                samples[i].append((time.perf_counter() - begin) * 1e6 / CALLS)
        us = [statistics.median(times) for times in samples]
        rows += [(op, shape, label, t, t / us[0], n)
                 for (label, *_), t, n in zip(variants, us, calls)]
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    return pd.DataFrame(rows, columns=["op", "shape", "variant", "us", "x eager fp32",
                                       "aten calls"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU")
    torch.set_num_threads(1)  # tiny ops: worker threads only add their wake-ups
    where = torch.cuda.get_device_name() if args.device == "cuda" else \
        "CPU, 1 torch thread, native execution"
    report = [f"torch {torch.__version__}, {where}; median of {args.repeats} round-robin "
              f"runs after {WARMUP} warm-up runs", load_line("before")]
    with execution("native" if args.device == "cpu" else "auto"):
        table = run(args.device, args.repeats)
    report.append(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    finish_report(report, args.out)


if __name__ == "__main__":
    main()
