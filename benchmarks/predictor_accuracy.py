"""How well does the simulator, fed the locally measured profile, predict real DDP steps?

For each model x plan, on the ``local-cpu`` cluster (2 ranks, gloo, batch 16 per rank):

1. profile this machine as the 2 DDP ranks will run (2 processes at once, 1 intra-op thread
   each): every op of the three models in fp32, bf16 and int8
   (:func:`qsync_lab.profile.profile_ops_concurrently`),
   the runtime's casts and DDP's in-place bucket copies (``fp32->fp32``; fitted per pair,
   R² printed) and gloo allreduces (α–β fitted);
   all written to ``data/profiles/cpu.csv`` (op rows matched by kind and shapes), and each
   model's op rows with their FQNs to ``benchmarks/results/profiles.tmp/<model>.csv``;
2. run ``torchrun --standalone --nproc_per_node=2 -m qsync_lab.runtime`` per case (SGD with
   momentum on the synthetic task): median step time and peak tensor memory (profiler
   memory events), and the simulator's prediction of the same case from those profiles,
   the model's own first (the run's ``summary.json``);
3. print measured beside predicted, the errors, and their medians against the targets
   (step time ≤ 5 %, peak memory ≤ 10 %).

Plans: ``fp32`` (nothing planned), ``bf16`` (every plannable op in bf16) and ``mixed``
(the first half of the GEMM ops — linear, conv — in int8, the rest fp32).

Run: ``.venv/bin/python benchmarks/predictor_accuracy.py [--steps 20] [--out FILE]``.
"""

import os

# the int8 kernels profile with the one thread a rank will have (set before numba loads)
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import argparse  # noqa: E402
import io
import json
import statistics
import subprocess
import tempfile
from contextlib import redirect_stdout
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from qsync_lab.cluster import load_cluster
from qsync_lab.graph import trace_graph
from qsync_lab.models import example_batch, get_model, model_spec
from qsync_lab.plan import Plan
from qsync_lab.profile import (METHODS, default_cast_sizes, default_copy_sizes, default_sizes,
                               fit_alpha_beta, fit_casts, fit_step_overhead, intra_op_threads,
                               link_metadata, profile_allreduce, profile_casts,
                               profile_ops_concurrently, run_metadata, step_overhead_metadata,
                               write_device_profile)
from qsync_lab.runtime.launch import torchrun_command
from qsync_lab.simulate import PLANNABLE_KINDS

ROOT = Path(__file__).resolve().parents[1]
MODEL_PROFILES = ROOT / "benchmarks/results/profiles.tmp"  # per-model op rows (git-ignored)
MODELS = {
    "digits_cnn": {},
    "resnet18": {"num_classes": 10, "image_size": 32},
    "bert_mini": {"seq_len": 32, "num_labels": 2, "vocab_size": 2000},
}
PRECISIONS = ("fp32", "bf16", "int8")
CAST_PAIRS = (("fp32", "bf16"), ("bf16", "fp32"), ("fp32", "int8"), ("int8", "fp16"),
              ("fp32", "fp16"), ("fp16", "fp32"))
GEMM_KINDS = ("linear", "conv2d")
CLUSTER = "local-cpu"
THREADS = 1
STEP_TARGET_PCT, MEMORY_TARGET_PCT = 5.0, 10.0
MIB = 2**20


def plans(graph) -> dict[str, dict[str, str]]:
    """fp32, uniform bf16 and mixed int8/fp32 plans for one model's graph."""
    ops = graph.ops
    plannable = [name for name, kind in ops["kind"].items() if kind in PLANNABLE_KINDS]
    gemms = [name for name, kind in ops["kind"].items() if kind in GEMM_KINDS]
    return {"fp32": {}, "bf16": {name: "bf16" for name in plannable},
            "mixed": {name: "int8" for name in gemms[:len(gemms) // 2]}}


def build_profile(path: Path, batch_size: int, repeats: int, method: str) -> list[str]:
    """Profile the three models (ops timed by ``method``), the casts and the allreduces;
    return report lines."""
    torch.set_num_threads(THREADS)
    frames = []
    for name, kwargs in tqdm(MODELS.items(), desc="profile models"):
        inputs, target = example_batch(name, batch_size, **kwargs)
        rows = profile_ops_concurrently(get_model(name, **kwargs), inputs, target,
                                        model_spec(name).loss_fn(), PRECISIONS, processes=2,
                                        threads=THREADS, repeats=repeats, method=method)
        # the model's own file keeps the FQNs (the runs read it first); in the shared file
        # FQNs ("conv1", "fc") would collide across models, so there rows match by
        # (kind, shapes) only, which is model-independent
        write_device_profile(MODEL_PROFILES / f"{name}.csv", [rows],
                             run_metadata("cpu", threads=THREADS))
        frames.append(rows.assign(op=""))
    casts = pd.concat([profile_casts(CAST_PAIRS, default_cast_sizes(), repeats=repeats),
                       profile_casts([("fp32", "fp32")], default_copy_sizes(), repeats=repeats)])
    cast_fits = fit_casts(casts)
    allreduce = profile_allreduce(default_sizes(), repeats=repeats)
    link_name = load_cluster(CLUSTER).intra_node_links[0].name
    link = fit_alpha_beta(allreduce["bytes"], allreduce["time_us"], world_size=2,
                          link=link_name, source=f"profile:{path.name}")
    with intra_op_threads(THREADS):
        overhead = fit_step_overhead(repeats=repeats, method=method)
    metadata = {**run_metadata("cpu", threads=THREADS), "profile_method": method,
                **step_overhead_metadata(overhead),
                **{f"cast_r2.{pair}": f"{fit.r2:.4f}" for pair, fit in cast_fits.items()},
                **link_metadata(link.link, r2=link.line.r2, world_size=2, backend="gloo")}
    write_device_profile(path, [*frames, casts], metadata)
    lines = [f"profile: {os.path.relpath(path, ROOT)} ({sum(map(len, frames))} op rows, "
             f"{THREADS} thread, ops timed {method})", "cast fits (time_us = a*numel + b):"]
    lines += [f"  {pair:12s} a={fit.slope * 1e3:8.4f} ns/elem  b={fit.intercept:7.2f} us  "
              f"R2={fit.r2:.4f}" for pair, fit in cast_fits.items()]
    lines.append(f"step overhead fit (calibration MLPs): {overhead.intercept:.1f} us per step "
                 f"{overhead.slope:+.2f} us per op event, R2={overhead.r2:.4f}")
    lines.append(f"allreduce fit ({link_name}, gloo, 2 ranks): alpha={link.link.latency_s * 1e6:.1f}"
                 f" us  beta={link.link.bandwidth_Bps / 1e9:.3f} GB/s  R2={link.line.r2:.4f}")
    return lines


def measure(name: str, kwargs: dict, plan: dict, steps: int, folder: Path,
            profile: Path) -> dict:
    """One torchrun DDP run of a case (``python -m qsync_lab.runtime``); its summary, which
    holds the measurement and the simulator's prediction from ``profile``."""
    cluster = load_cluster(CLUSTER)
    graph = _graph(name, kwargs, cluster.ranks[0].batch_size)
    plan_path, run_dir = folder / "plan.json", folder / "run"
    Plan.build(graph, cluster, {"cpu": plan}, strategy="benchmark").for_model(
        name, kwargs).save(plan_path)
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "NUMBA_NUM_THREADS": str(THREADS)}
    subprocess.run(torchrun_command(str(plan_path), 2, runtime_args=[
        "--data", "synthetic", "--steps", str(steps), "--checkpoint-every", "0",
        "--threads", str(THREADS), "--profile", str(MODEL_PROFILES / f"{name}.csv"),
        "--profile", str(profile), "--run-dir", str(run_dir)]),
        check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", type=Path, default=ROOT / "data/profiles/cpu.csv")
    parser.add_argument("--method", choices=METHODS, default="in_step",
                        help="how ops are timed (qsync_lab.profile.profile_ops)")
    parser.add_argument("--reuse-profile", action="store_true",
                        help="use the existing profile instead of measuring it again")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    cluster = load_cluster(CLUSTER)
    batch_size = cluster.ranks[0].batch_size
    load = os.getloadavg()
    report = [f"predictor accuracy on {CLUSTER} (2 ranks x {THREADS} thread, batch "
              f"{batch_size}/rank), torch {torch.__version__}; 1/5/15-min load before: "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"]
    if not args.reuse_profile:
        report += build_profile(args.profile, batch_size, args.repeats, args.method)
    rows = []
    cases = [(name, plan_name, plan) for name, kwargs in MODELS.items()
             for plan_name, plan in plans(_graph(name, kwargs, batch_size)).items()]
    with tempfile.TemporaryDirectory() as folder:
        for name, plan_name, plan in tqdm(cases, desc="DDP runs"):
            run = measure(name, MODELS[name], plan, args.steps, Path(folder), args.profile)
            rows.append({"model": name, "plan": plan_name,
                         "step_ms": run["measured_step_ms"], "pred_ms": run["predicted_step_ms"],
                         "step_err_%": run["step_error_pct"],
                         "peak_MiB": run["measured_peak_memory_mib"],
                         "pred_MiB": run["predicted_peak_memory_mib"],
                         "mem_err_%": run["memory_error_pct"]})
    table = pd.DataFrame(rows)
    step_mae = statistics.median(table["step_err_%"].abs())
    mem_mae = statistics.median(table["mem_err_%"].abs())
    load = os.getloadavg()
    report += ["", table.to_string(index=False, float_format=lambda v: f"{v:.2f}"), "",
               f"median |error| step time: {step_mae:.2f} % (target <= {STEP_TARGET_PCT:g} %)"
               f" {'MET' if step_mae <= STEP_TARGET_PCT else 'MISSED'}",
               f"median |error| peak memory: {mem_mae:.2f} % (target <= {MEMORY_TARGET_PCT:g} %)"
               f" {'MET' if mem_mae <= MEMORY_TARGET_PCT else 'MISSED'}",
               f"1/5/15-min load after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"]
    text = "\n".join(report)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def _graph(name: str, kwargs: dict, batch_size: int):
    inputs, target = example_batch(name, batch_size, **kwargs)
    with redirect_stdout(io.StringIO()):
        return trace_graph(get_model(name, **kwargs), inputs, target=target,
                           loss_fn=model_spec(name).loss_fn())


if __name__ == "__main__":
    main()
