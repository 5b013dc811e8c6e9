"""Measured DDP training steps under a precision plan: a torchrun entry point.

``torchrun --standalone --nproc_per_node=2 -m qsync_lab.runtime.ddp_step --model digits_cnn
--cluster local-cpu --plan plan.json --steps 10 --out result.json`` runs, on every rank:

1. the rank's plan: the plan's entry for the rank's device kind (``cluster``), resolved by
   the simulator's policy (:func:`qsync_lab.simulate.resolve_precisions`: activations and
   other inheriting ops follow their producers) and applied op by op with
   :func:`~qsync_lab.runtime.apply_plan_` to every op the runtime can set (functions
   such as ``add`` always run in fp32 here);
2. DDP over gloo (CPU) or NCCL (CUDA), plain SGD, one fixed synthetic batch of the
   rank's batch size (:func:`qsync_lab.models.example_batch`, seeded by rank);
3. peak tensor memory: on the CPU, ``torch.profiler`` memory events from before the model
   is built through two training steps, summed in time order (every tensor the run
   allocates is inside that window, so the running sum is the live tensor bytes; the
   peak is its maximum); on CUDA, ``torch.cuda.max_memory_allocated`` over the steps;
4. ``warmup`` untimed steps, then ``steps`` timed steps (wall clock of zero_grad, forward,
   loss, backward with its overlapped allreduces, optimizer step; CUDA synchronised).

Rank 0 writes ``out`` (JSON): per rank the device kind, batch size, applied precisions,
step times, their median and the peak memory; ``median_step_ms`` is the largest rank
median (the ranks wait for each other in every allreduce).

``--threads`` sets torch's and Numba's thread counts per rank (default: cores / local ranks).
"""

import argparse
import json
import os
import statistics
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from qsync_lab.cluster import load_cluster
from qsync_lab.costs import op_work
from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph
from qsync_lab.models import example_batch, get_model, model_spec
from qsync_lab.precision import Precision
from qsync_lab.runtime.apply import apply_plan_
from qsync_lab.simulate.policy import resolve_precisions

__all__ = ["main", "resolved_runtime_plan"]

_MEMORY_STEPS = 2
_BYTES_PER_MIB = 2**20


def resolved_runtime_plan(model: nn.Module, graph, kind_plan: Mapping[str, str],
                          device) -> dict[str, str]:
    """Apply ``kind_plan`` as the simulator resolves it, in place; return what was applied.

    Every op whose resolved precision is not fp32 is set if the runtime can set it (a
    module of a plannable or boundary kind); the others keep running in fp32.

    Example::

        >>> import torch, torch.nn as nn
        >>> from qsync_lab.devices import load_catalog
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> graph = trace_graph(model, torch.randn(3, 4))
        >>> resolved_runtime_plan(model, graph, {"0": "bf16"}, load_catalog().device("cpu"))
        {'0': 'bf16', '1': 'bf16'}
    """
    work = op_work(graph)
    assignment = resolve_precisions(work, dict(kind_plan), device)
    modules = dict(model.named_modules())
    applied = {}
    for name, precision in zip(work.names, assignment.precision):
        if precision is Precision.FP32 or name not in modules:
            continue
        try:
            apply_plan_(model, {name: precision}, device=device)
        except QSyncError:
            continue
        applied[name] = str(precision)
    return applied


def _parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--model-kwargs", default="{}", help="JSON dict for get_model")
    parser.add_argument("--cluster", default="local-cpu")
    parser.add_argument("--plan", help="JSON file: device kind -> {op FQN -> precision}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def _peak_cpu_bytes(prof) -> int:
    """Maximum running sum of the profiler's allocation records (``[memory]`` events:
    +bytes per allocation, -bytes per free), in time order."""
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return peak


def main(argv=None) -> None:
    """The torchrun entry (see the module docstring)."""
    args = _parse(argv)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = args.threads or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    # the int8 kernels' Numba pool: set before numba is first imported (the kernels import it
    # lazily); numba.set_num_threads here makes the process abort at exit beside gloo
    os.environ.setdefault("NUMBA_NUM_THREADS", str(threads))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    cluster = load_cluster(args.cluster)
    if cluster.world_size != world:
        raise QSyncError(f"cluster {args.cluster!r} has {cluster.world_size} ranks but "
                         f"torchrun started {world}; use --nproc_per_node={cluster.world_size}")
    spec = cluster.ranks[rank]
    plan = json.loads(Path(args.plan).read_text()) if args.plan else {}
    kwargs = json.loads(args.model_kwargs)
    inputs, target = example_batch(args.model, spec.batch_size, seed=rank, **kwargs)
    loss_fn = model_spec(args.model).loss_fn()

    def build():
        torch.manual_seed(0)
        model = get_model(args.model, **kwargs)
        graph = trace_graph(model, inputs, target=target, loss_fn=loss_fn)
        applied = resolved_runtime_plan(model, graph, plan.get(spec.device, {}),
                                        cluster.catalog.device(spec.device))
        model = model.to(device) if cuda else model
        ddp = DistributedDataParallel(model, device_ids=[device] if cuda else None)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), applied

    batch = tuple(t.to(device) for t in inputs) if cuda else inputs
    labels = target.to(device) if cuda else target

    def step(ddp, optimizer) -> None:
        optimizer.zero_grad()
        loss_fn(ddp(*batch), labels).backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        ddp, optimizer, applied = build()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(_MEMORY_STEPS):
            step(ddp, optimizer)
        peak = torch.cuda.max_memory_allocated()
    else:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            ddp, optimizer, applied = build()
            for _ in range(_MEMORY_STEPS):
                step(ddp, optimizer)
        peak = _peak_cpu_bytes(prof)
    for _ in range(args.warmup):
        step(ddp, optimizer)
    times_ms = []
    for _ in range(args.steps):
        begin = time.perf_counter()
        step(ddp, optimizer)
        times_ms.append((time.perf_counter() - begin) * 1e3)
    mine = {"rank": rank, "device": spec.device, "batch_size": spec.batch_size,
            "threads": torch.get_num_threads(), "applied_plan": applied,
            "step_ms": times_ms, "median_step_ms": statistics.median(times_ms),
            "peak_memory_bytes": int(peak)}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        result = {"model": args.model, "model_kwargs": kwargs, "cluster": args.cluster,
                  "backend": dist.get_backend(), "steps": args.steps, "warmup": args.warmup,
                  "median_step_ms": max(r["median_step_ms"] for r in gathered),
                  "peak_memory_mib": max(r["peak_memory_bytes"] for r in gathered)
                  / _BYTES_PER_MIB,
                  "ranks": gathered}
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
