"""Compressed gradient communication on gloo ranks: a 25 MB bucket end to end, accuracy, and
the simulator's prediction of compressed runs.

1. **bucket**: on 2 and 4 gloo ranks (1 intra-op thread each and freed memory kept, as the
   runtime runs them), each
   rank's gradient is one 25 MiB fp32 bucket (a 2560 x 2560 weight, DDP's default bucket cap
   is 25 MB). Each entry runs the bucket through a DDP comm hook from the call to the
   completed future (encode + communicate + decode, every rank's copy back included):
   PyTorch's default ``allreduce_hook`` (the fp32 allreduce), PyTorch's
   ``fp16_compress_hook``, and each spec through :func:`qsync_lab.compress.compression_hook`.
   The time is the slowest rank's, median of ``--repeats`` calls after 3 warm-up calls;
   bytes are what each rank sends per call (ring-equivalent counts: ``2(n-1)/n`` of an
   allreduced tensor, ``n-1`` times an all-gathered one). For the project's hooks, rank 0's
   telemetry (median encode and decode ms per call: the host clock on the CPU, CUDA events
   on the bucket's stream on a GPU) stands beside what the simulator predicts for them
   (:func:`qsync_lab.simulate.compression.compressor_costs`) from ``--profile`` (default:
   the shipped CPU profile on the CPU, the catalog's roofline on a GPU); ``pred_ms`` is
   their sum, to compare with ``encode_ms + decode_ms``.
2. **runs**: per spec (and without compression), ``torchrun ... -m qsync_lab.runtime`` on the
   ``local-cpu`` cluster (2 gloo ranks, batch 16 each), as ``qsync-lab run`` starts it and
   with the shipped profile ``data/profiles/cpu.csv`` (the user's path), or with
   ``--profile`` a profile of this machine (as the README's ``qsync-lab profile ...
   --compress`` writes it; the shipped one was measured on another day, and the VM's speed
   drifts): the digits CNN on
   the real digits data for ``--digits-steps`` steps (its test accuracy), and ResNet-18 on
   synthetic data for ``--resnet-steps`` steps (its 44 MB of gradients make communication
   a large part of the step). Each run's ``summary.json`` gives the measured median step
   and the simulator's prediction of the same plan; the target is within 10 %.

With ``--device cuda`` the buckets of section 1 live on the GPUs (rank r on GPU r modulo
their count) and the collectives run on NCCL (``--backend gloo`` for gloo's CUDA path); NCCL
needs one GPU per rank.

Run: ``.venv/bin/python benchmarks/compression.py [--repeats 20] [--profile CSV] [--out FILE]
[--device cuda --worlds 1 --skip-runs]``.
"""

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # one thread per rank, set before numba loads
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from tqdm.auto import tqdm

from qsync_lab.cluster import load_cluster
from qsync_lab.compress import CompressionSpec
from qsync_lab.compress.hook import CompressionState, StandaloneBucket, compression_hook
from qsync_lab.costs import CostModel, load_cost_model
from qsync_lab.devices import load_catalog
from qsync_lab.graph import trace_graph
from qsync_lab.hostmem import keep_freed_memory
from qsync_lab.models import example_batch, get_model, model_spec
from qsync_lab.plan import Plan
from qsync_lab.profile.device import profile_device_name
from qsync_lab.runtime.launch import torchrun_command
from qsync_lab.simulate.compression import compressor_costs
from reporting import finish_report, load_line

ROOT = Path(__file__).resolve().parents[1]
SPECS = ("fp16", "bf16", "global_qsgd:8", "aps:fp8_e5m2", "cgx:8", "cgx:4",
         "cgx:4,error_feedback=true", "qsgd:8")
BUCKET_SHAPE = (2560, 2560)  # 6,553,600 float32 = 25 MiB
WARMUP = 3
CLUSTER = "local-cpu"
RUNS = {"digits_cnn": ({}, "digits"),
        "resnet18": ({"num_classes": 10, "image_size": 32}, "synthetic")}
TARGET_PCT = 10.0


# ----------------------------------------------------------------------------- 1. bucket


def _bucket_rank(rank: int, world: int, port: int, repeats: int, results, device: str,
                 backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":  # the ranks share the machine's GPUs
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    torch.set_num_threads(1)
    keep_freed_memory()  # as the training ranks (qsync_lab.hostmem)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    model = nn.Module()
    model.weight = nn.Parameter(torch.empty(BUCKET_SHAPE))
    gradient = torch.randn(model.weight.numel(),
                           generator=torch.Generator().manual_seed(rank)).to(device)
    buffer = torch.empty_like(gradient)
    bucket = StandaloneBucket(model.weight, buffer)
    numel, ring = gradient.numel(), 2 * (world - 1) / world
    entries = [("fp32 allreduce (torch allreduce_hook)",
                lambda: default_hooks.allreduce_hook(None, bucket), ring * 4 * numel),
               ("torch fp16_compress_hook",
                lambda: default_hooks.fp16_compress_hook(None, bucket), ring * 2 * numel)]
    states = []
    for text in SPECS:
        state = CompressionState(model, text, telemetry=False)
        states.append(state)
        entries.append((text, lambda state=state: compression_hook(state, bucket), state))
    rows = []
    for name, hook, sent in entries:
        slowest, parts = [], []
        for call in range(WARMUP + repeats):
            buffer.copy_(gradient)
            sent_before = sent.comm.sent_bytes if isinstance(sent, CompressionState) else 0.0
            sync()
            dist.barrier()
            begin = time.perf_counter()
            hook().wait()
            sync()
            seconds = torch.tensor([time.perf_counter() - begin], device=device)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            if isinstance(sent, CompressionState):  # read (and reset) after every call
                (stats,) = sent.telemetry().values()
                if call >= WARMUP:
                    parts.append((stats["encode_ms"], stats["decode_ms"]))
            if call >= WARMUP:
                slowest.append(float(seconds))
        sent_bytes = (sent.comm.sent_bytes - sent_before if isinstance(sent, CompressionState)
                      else sent)
        rows.append({"ranks": world, "method": name,
                     "median_ms": 1e3 * statistics.median(slowest),
                     "min_ms": 1e3 * min(slowest), "max_ms": 1e3 * max(slowest),
                     "sent_MiB": sent_bytes / 2**20,
                     "encode_ms": statistics.median(p[0] for p in parts) if parts else None,
                     "decode_ms": statistics.median(p[1] for p in parts) if parts else None})
    for state in states:
        state.close()
    dist.destroy_process_group()
    if rank == 0:
        results.put(rows)


def bucket_table(worlds, repeats: int, device: str = "cpu", backend: str = "gloo",
                 profiles=()) -> pd.DataFrame:
    """Section 1: one row per (ranks, method), the buckets on ``device`` ("cpu" or "cuda"),
    the project's hooks predicted from ``profiles``."""
    rows = []
    for world in worlds:
        context = mp.get_context("spawn")
        results = context.Queue()
        port = 29500 + (os.getpid() + world) % 2000
        processes = [context.Process(target=_bucket_rank, args=(r, world, port, repeats, results,
                                                               device, backend))
                     for r in range(world)]
        for process in processes:
            process.start()
        rows += results.get(timeout=1800)
        for process in processes:
            process.join()
            if process.exitcode != 0:
                raise SystemExit(f"a bucket rank failed (exit {process.exitcode})")
    table = pd.DataFrame(rows)
    fp32 = table.groupby("ranks")["median_ms"].transform("first")  # the first row of each
    table["x_fp32"] = table["median_ms"] / fp32
    table["pred_ms"] = _predicted_ms(table, device, profiles)
    return table


def _predicted_ms(table: pd.DataFrame, device: str, profiles) -> list[float | None]:
    """Per row, the simulator's encode + decodes of the row's spec on this device."""
    name = profile_device_name(device)
    catalog = load_catalog()
    if name not in catalog.devices:
        return [None] * len(table)
    costs = (load_cost_model(*profiles) if profiles
             else load_cost_model(ROOT / "data/profiles/cpu.csv") if device == "cpu"
             else CostModel())
    numel = BUCKET_SHAPE[0] * BUCKET_SHAPE[1]
    out = []
    for method, world in zip(table["method"], table["ranks"]):
        if method not in SPECS:
            out.append(None)
            continue
        encode, decode = compressor_costs(costs, CompressionSpec.parse(method), numel,
                                          [(0, numel)], int(world), catalog.device(name))
        out.append((encode.us + decode.us) / 1e3)
    return out


# ----------------------------------------------------------------------------- 2. runs


def _graph(name: str, kwargs: dict, batch_size: int):
    inputs, target = example_batch(name, batch_size, **kwargs)
    return trace_graph(get_model(name, **kwargs), inputs, target=target,
                       loss_fn=model_spec(name).loss_fn())


def run_case(name: str, spec: str | None, steps: int, folder: Path,
             profiles: list[Path] = ()) -> dict:
    """One 2-rank run of ``name`` with ``spec`` (predicted with ``profiles``, default the
    shipped one); its summary.json."""
    kwargs, data = RUNS[name]
    cluster = load_cluster(CLUSTER)
    graph = _graph(name, kwargs, cluster.ranks[0].batch_size)
    plan_path, run_dir = folder / "plan.json", folder / f"{name}-{spec or 'none'}"
    Plan.build(graph, cluster, {}, strategy="benchmark", compression=spec).for_model(
        name, kwargs).save(plan_path)
    subprocess.run(torchrun_command(str(plan_path), 2, runtime_args=[
        "--data", data, "--steps", str(steps), "--warmup-steps", str(steps // 5),
        "--checkpoint-every", "0", "--threads", "1", "--run-dir", str(run_dir),
        *[arg for path in profiles for arg in ("--profile", str(path))]]),
        check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"})
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"model": name, "compression": spec or "none", "steps": steps,
            "test_accuracy": summary["test_accuracy"],
            "step_ms": summary["measured_step_ms"], "pred_ms": summary["predicted_step_ms"],
            "step_err_%": summary["step_error_pct"]}


def runs_table(steps: dict[str, int], profiles: list[Path] = ()) -> pd.DataFrame:
    rows = []
    cases = [(name, spec) for name in RUNS for spec in (None, *SPECS)]
    with tempfile.TemporaryDirectory() as folder:
        for name, spec in tqdm(cases, desc="runs"):
            rows.append(run_case(name, spec, steps[name], Path(folder), profiles))
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--digits-steps", type=int, default=300)
    parser.add_argument("--resnet-steps", type=int, default=40)
    parser.add_argument("--skip-runs", action="store_true", help="only the bucket table")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the buckets live (cuda: rank r on GPU r modulo the count)")
    parser.add_argument("--backend", choices=("gloo", "nccl"),
                        help="collectives (default: gloo for cpu, nccl for cuda)")
    parser.add_argument("--profile", type=Path, action="append", default=[],
                        help="predict the hooks and runs with this profile (default: the "
                        "shipped CPU one; on a GPU the catalog's roofline)")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    if args.repeats < 20:
        parser.error("--repeats must be at least 20 (medians of fewer calls are noise here)")
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    where = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
             if args.device == "cuda" else f"{os.cpu_count()} cores")
    report = [f"compressed gradient communication, {backend} on {where}, torch "
              f"{torch.__version__}, 1 intra-op thread per rank; {load_line('before')}", "",
              f"1. one 25 MiB fp32 bucket ({BUCKET_SHAPE[0]} x {BUCKET_SHAPE[1]} weight), hook "
              f"call to completed future, slowest rank, median of {args.repeats} "
              f"(min-max beside it); x_fp32 = time / the fp32 allreduce's; encode_ms, "
              "decode_ms: rank 0's telemetry (median); pred_ms: the simulator's encode + "
              "decode from "
              + (", ".join(map(str, args.profile)) if args.profile
                 else "data/profiles/cpu.csv" if args.device == "cpu"
                 else "the catalog's roofline")]
    buckets = bucket_table(args.worlds, args.repeats, args.device, backend,
                           [path.resolve() for path in args.profile])
    report.append(buckets.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    two = buckets[buckets["ranks"] == 2].set_index("method")["median_ms"]
    fp32, fp16 = ((two.iloc[0], two.loc["torch fp16_compress_hook"]) if len(two)
                  else (None, None))  # no 2-rank table, no verdict
    for spec in ("global_qsgd:8", "aps:fp8_e5m2", "cgx:8", "qsgd:8"):
        if spec in two:
            verdict = ("MET" if two[spec] <= 0.5 * fp32 and two[spec] < fp16 else "MISSED")
            report.append(f"target 8-bit {spec} on 2 ranks <= 0.5x fp32 ({0.5 * fp32:.2f} ms) "
                          f"and < torch fp16 hook ({fp16:.2f} ms): {two[spec]:.2f} ms {verdict}")
    if not args.skip_runs:
        runs = runs_table({"digits_cnn": args.digits_steps, "resnet18": args.resnet_steps},
                          [path.resolve() for path in args.profile])
        worst = runs["step_err_%"].abs().max()
        source = (", ".join(map(str, args.profile)) if args.profile
                  else "the shipped data/profiles/cpu.csv")
        report += ["", "2. runs on local-cpu (2 gloo ranks x 1 thread, batch 16 each), "
                   f"torchrun -m qsync_lab.runtime, predictions from {source}; "
                   "digits_cnn on the digits data (test accuracy), resnet18 on synthetic data",
                   runs.to_string(index=False, float_format=lambda v: f"{v:.3f}"),
                   f"largest |step error|: {worst:.1f} % (target <= {TARGET_PCT:g} %) "
                   f"{'MET' if worst <= TARGET_PCT else 'MISSED'}"]
    finish_report(report, args.out)


if __name__ == "__main__":
    main()
