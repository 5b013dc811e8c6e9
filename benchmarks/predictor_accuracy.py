"""How well does the simulator, fed the locally measured profile, predict real DDP steps?

For each model x plan, on the ``local-cpu`` cluster (2 ranks, gloo, batch 16 per rank):

1. profile this machine: the runtime's casts and DDP's in-place bucket copies
   (``fp32->fp32``; fitted per pair, R² printed), gloo allreduces on idle ranks (α–β,
   printed) and the link as DDP steps of calibration MLPs see it (α–β,
   :mod:`qsync_lab.profile.ddp_link`; the one used), the step overhead, and the gradient
   compressors' encode and decode through the hook
   (:data:`~qsync_lab.profile.DEFAULT_COMPRESSION_SPECS`, for ``benchmarks/compression.py``
   and every compressed run), written to ``data/profiles/cpu.csv``;
2. per model, right before its runs (this VM's speed drifts over minutes): every op in
   fp32, bf16 and int8, timed inside training steps in 2 processes at once as the 2 DDP
   ranks will run, 1 intra-op thread each (:func:`qsync_lab.profile.profile_ops_concurrently`),
   written with their FQNs to ``benchmarks/results/profiles.tmp/<model>.csv``, and then
3. run ``torchrun --standalone --nproc_per_node=2 -m qsync_lab.runtime`` per case (SGD with
   momentum on the synthetic task): median step time and peak tensor memory (profiler
   memory events), and the simulator's prediction of the same case from those profiles,
   the model's own first (the run's ``summary.json``). At the end every model's op rows
   join ``data/profiles/cpu.csv``, matched there by kind and shapes;
4. print measured beside predicted (medians over the rounds), the errors (per round, each
   prediction against the runs it was profiled right before; then the median over the
   rounds), and the medians of the cases' errors against the targets (step time ≤ 5 %,
   peak memory ≤ 10 %); with ``--out``, every run also goes to ``<out>.runs.csv``.

Plans: ``fp32`` (nothing planned), ``bf16`` (every plannable op in bf16) and ``mixed``
(the first half of the GEMM ops — linear, conv — in int8, the rest fp32).

Run: ``.venv/bin/python benchmarks/predictor_accuracy.py [--steps N] [--out FILE]``.
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
from qsync_lab.costs import link_metadata, load_cost_model, write_device_profile
from qsync_lab.graph import trace_graph
from qsync_lab.models import example_batch, get_model, model_spec
from qsync_lab.plan import Plan
from qsync_lab.profile import (DEFAULT_COMPRESSION_SPECS, METHODS, copy_pass_us,
                               default_cast_sizes, default_compression_sizes,
                               default_copy_sizes, default_sizes, fit_alpha_beta,
                               fit_buffer_broadcast, fit_casts, fit_compressed_steps,
                               fit_ddp_link, fit_step_overhead, intra_op_threads,
                               measure_buffer_broadcast, measure_compressed_steps,
                               measure_ddp_overhead,
                               profile_allreduce, profile_casts, profile_compression,
                               profile_ops_concurrently, run_metadata, step_overhead_metadata)
from qsync_lab.policy import PLANNABLE_KINDS
from qsync_lab.runtime.launch import torchrun_command

ROOT = Path(__file__).resolve().parents[1]
MODEL_PROFILES = ROOT / "benchmarks/results/profiles.tmp"  # per-model op rows (git-ignored)
SHIPPED_PROFILE = ROOT / "data/profiles/cpu.csv"
MODELS = {
    "digits_cnn": {},
    "resnet18": {"num_classes": 10, "image_size": 32},
    "bert_mini": {"seq_len": 32, "num_labels": 2, "vocab_size": 2000},
}
#: DDP steps per run: a few seconds of steps each (a digits_cnn step is ~3 ms, and its
#: gloo latency spikes make a short run's median noisy); the first fifth are warm-up
STEPS = {"digits_cnn": 300, "resnet18": 40, "bert_mini": 30}
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
    plannable = [name for name, kind in ops["kind"].items()
                 if kind in PLANNABLE_KINDS and not ops.at[name, "plan_refusal"]]
    gemms = [name for name, kind in ops["kind"].items() if kind in GEMM_KINDS]
    return {"fp32": {}, "bf16": {name: "bf16" for name in plannable},
            "mixed": {name: "int8" for name in gemms[:len(gemms) // 2]}}


def profile_model(name: str, batch_size: int, repeats: int, method: str) -> pd.DataFrame:
    """Time one model's ops (by ``method``) in 2 processes at once, as the ranks run; write
    them with their FQNs to the model's own profile and return them."""
    torch.set_num_threads(THREADS)
    kwargs = MODELS[name]
    inputs, target = example_batch(name, batch_size, **kwargs)
    rows = profile_ops_concurrently(get_model(name, **kwargs), inputs, target,
                                    model_spec(name).loss_fn(), PRECISIONS, processes=2,
                                    threads=THREADS, repeats=repeats, method=method)
    write_device_profile(MODEL_PROFILES / f"{name}.csv", [rows],
                         run_metadata("cpu", threads=THREADS))
    return rows


def profile_machine(path: Path, repeats: int, method: str) -> tuple[pd.DataFrame, dict, list]:
    """Profile the casts, DDP's copies, the allreduces, the step overhead and the gradient
    compressors and write them to ``path``; return the cast and compression rows, the
    metadata and report lines."""
    torch.set_num_threads(THREADS)
    casts = pd.concat([profile_casts(CAST_PAIRS, default_cast_sizes(), repeats=repeats),
                       profile_casts([("fp32", "fp32")], default_copy_sizes(), repeats=repeats)])
    cast_fits = fit_casts(casts)
    allreduce = profile_allreduce(default_sizes(), repeats=3 * repeats)  # latency is noisy here
    link_name = load_cluster(CLUSTER).intra_node_links[0].name
    alone = fit_alpha_beta(allreduce["bytes"], allreduce["time_us"], world_size=2,
                           link=link_name, source=f"profile:{path.name}")
    link = fit_ddp_link(measure_ddp_overhead(threads=THREADS), copy_pass_us(cast_fits),
                        link=link_name, source=f"profile:{path.name} ddp-calibration")
    broadcast = fit_buffer_broadcast(measure_buffer_broadcast(threads=THREADS), link.link)
    with intra_op_threads(THREADS):
        overhead = fit_step_overhead(repeats=repeats, method=method)
        compression = profile_compression(DEFAULT_COMPRESSION_SPECS, default_compression_sizes(),
                                          repeats=repeats)
    metadata = {**run_metadata("cpu", threads=THREADS), "profile_method": method,
                **step_overhead_metadata(overhead),
                **{f"cast_r2.{pair}": f"{fit.r2:.4f}" for pair, fit in cast_fits.items()},
                **link_metadata(link.link, r2=link.line.r2, world_size=2, backend="gloo"),
                **link_metadata(broadcast, r2=float("nan"), world_size=2, backend="gloo")}
    write_device_profile(path, [casts, compression], metadata)  # what the estimate reads
    calibration = measure_compressed_steps(DEFAULT_COMPRESSION_SPECS, threads=THREADS)
    in_step = fit_compressed_steps(calibration, load_cost_model(path), load_cluster(CLUSTER))
    compression = pd.concat([compression, in_step])
    write_device_profile(path, [casts, compression], metadata)
    lines = ["cast fits (time_us = a*numel + b):"]
    lines += [f"  {pair:12s} a={fit.slope * 1e3:8.4f} ns/elem  b={fit.intercept:7.2f} us  "
              f"R2={fit.r2:.4f}" for pair, fit in cast_fits.items()]
    lines.append(f"step overhead fit (calibration MLPs): {overhead.intercept:.1f} us per step "
                 f"{overhead.slope:+.2f} us per op event, R2={overhead.r2:.4f}")
    lines += [f"allreduce fit ({link_name}, gloo, 2 ranks, {what}): alpha="
              f"{fit.link.latency_s * 1e6:.1f} us  beta={fit.link.bandwidth_Bps / 1e9:.3f} GB/s"
              f"  R2={fit.line.r2:.4f}"
              for what, fit in (("idle ranks, not used", alone),
                                ("DDP steps of calibration MLPs, used", link))]
    lines.append(f"DDP buffer broadcast (BatchNorm MLPs, with/without forward_sync_buffers): "
                 f"alpha={broadcast.latency_s * 1e6:.1f} us per hop")
    largest = compression[compression["numel"] == compression["numel"].max()]
    lines.append(f"compression through the hook, ns/elem at {int(largest['numel'].iloc[0]):,} "
                 "elements (encode / decode of one payload): " + ", ".join(
                     f"{spec} {1e3 * g.set_index('kind').at['encode', 'time_us'] / n:.2f} / "
                     f"{1e3 * g.set_index('kind').at['decode', 'time_us'] / n:.2f}"
                     for (spec, n), g in largest.groupby(["op", "numel"], sort=False)))
    lines.append("compression in DDP steps of calibration MLPs, added beyond the estimate per "
                 "group call (us, per MLP): " + "; ".join(
                     f"{spec} " + " ".join(f"{t:+.0f}" for t in g["time_us"])
                     for spec, g in in_step.groupby("op", sort=False)))
    return pd.concat([casts, compression]), metadata, lines


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
        "--data", "synthetic", "--steps", str(steps), "--warmup-steps", str(steps // 5),
        "--checkpoint-every", "0",
        "--threads", str(THREADS), "--profile", str(MODEL_PROFILES / f"{name}.csv"),
        "--profile", str(profile), "--run-dir", str(run_dir)]),
        check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="DDP steps per run (default: STEPS)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3,
                        help="profile and run every case this many times (medians)")
    parser.add_argument("--profile", type=Path, default=SHIPPED_PROFILE)
    parser.add_argument("--method", choices=METHODS, default="in_step",
                        help="how ops are timed (qsync_lab.profile.profile_ops)")
    parser.add_argument("--reuse-profile", action="store_true",
                        help="use the existing profile instead of measuring it again")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help="models to run (default: all)")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    subset = set(args.models) != set(MODELS)
    if subset and args.profile.resolve() == SHIPPED_PROFILE and not args.reuse_profile:
        parser.error("--models with a subset rewrites the profile without the other models' "
                     "rows; give --profile another path (e.g. /tmp/cpu.csv)")
    cluster = load_cluster(CLUSTER)
    batch_size = cluster.ranks[0].batch_size
    load = os.getloadavg()
    report = [f"predictor accuracy on {CLUSTER} (2 ranks x {THREADS} thread, batch "
              f"{batch_size}/rank), torch {torch.__version__}; 1/5/15-min load before: "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"]
    if not args.reuse_profile:
        machine_rows, metadata, lines = profile_machine(args.profile, args.repeats, args.method)
        report += lines
    runs, model_rows = [], {}
    with tempfile.TemporaryDirectory() as folder:
        for round_index in tqdm(range(args.rounds), desc="rounds"):
            for name in args.models:
                kwargs = MODELS[name]
                if not args.reuse_profile:  # right before its runs: the machine drifts
                    model_rows[name] = profile_model(name, batch_size, args.repeats,
                                                     args.method)
                for plan_name, plan in plans(_graph(name, kwargs, batch_size)).items():
                    run = measure(name, kwargs, plan, args.steps or STEPS[name], Path(folder),
                                  args.profile)
                    runs.append({"round": round_index, "model": name, "plan": plan_name,
                                 "step_ms": run["measured_step_ms"],
                                 "pred_ms": run["predicted_step_ms"],
                                 "peak_MiB": run["measured_tensor_peak_mib"],
                                 "pred_MiB": run["predicted_tensor_peak_mib"]})
    runs = pd.DataFrame(runs)
    table = summarize(runs)
    if model_rows:  # the machine's rows and every model's rows, by shape only (FQNs such
        # as "conv1" and "fc" collide across models)
        write_device_profile(args.profile, [*(r.assign(op="") for r in model_rows.values()),
                                            machine_rows], metadata)
        report.insert(1, f"profile: {os.path.relpath(args.profile, ROOT)} and "
                         f"{os.path.relpath(MODEL_PROFILES, ROOT)}/<model>.csv "
                         f"({sum(map(len, model_rows.values()))} op rows, {THREADS} thread, "
                         f"ops timed {args.method}, each model right before its runs); "
                         f"{args.rounds} rounds of profile + runs, medians over the rounds "
                         "(errors: each round's prediction against its own runs), spread = "
                         "(max - min) / median of the measured step; every run in "
                         "<out>.runs.csv")
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
        runs.to_csv(args.out.with_suffix(".runs.csv"), index=False, float_format="%.3f")


def summarize(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per case: medians over the rounds of the measured and predicted step time
    and peak memory, the measured step's spread, and the errors: per round the prediction
    against the runs it was profiled right before (the machine drifts between rounds),
    then their median.

    Example::

        >>> runs = pd.DataFrame({"model": "m", "plan": "p", "step_ms": [9.0, 10.0, 12.0],
        ...                      "pred_ms": [9.9, 10.0, 11.4], "peak_MiB": 2.0,
        ...                      "pred_MiB": 2.2})
        >>> summarize(runs)[["step_ms", "spread_%", "pred_ms", "step_err_%"]].round(2).values.tolist()
        [[10.0, 30.0, 10.0, 0.0]]
    """
    runs = runs.assign(step_err=100 * (runs["pred_ms"] / runs["step_ms"] - 1),
                       mem_err=100 * (runs["pred_MiB"] / runs["peak_MiB"] - 1))
    cases = runs.groupby(["model", "plan"], sort=False)
    table = cases[["step_ms", "pred_ms", "peak_MiB", "pred_MiB"]].median().reset_index()
    steps = cases["step_ms"]
    table.insert(3, "spread_%", 100 * (steps.max() - steps.min()).values / table["step_ms"])
    table.insert(5, "step_err_%", cases["step_err"].median().values)
    table["mem_err_%"] = cases["mem_err"].median().values
    return table


def _graph(name: str, kwargs: dict, batch_size: int):
    inputs, target = example_batch(name, batch_size, **kwargs)
    with redirect_stdout(io.StringIO()):
        return trace_graph(get_model(name, **kwargs), inputs, target=target,
                           loss_fn=model_spec(name).loss_fn())


if __name__ == "__main__":
    main()
