"""Predicted against measured steps for models outside the zoo, on the user's path.

Each model of :mod:`qsync_lab.models.families` trains on the ``local-cpu`` cluster (2 gloo
ranks, batch 16 each, 1 thread) as a user's script would: ``torchrun
benchmarks/train_family.py``, i.e. ``qsync_lab.runtime.train(config, task=Task(...))``
with no profile given, so the model's ops are first timed on this machine, in as many
processes at once as there are ranks (cached in a fresh ``QSYNC_LAB_CACHE``), with its
training steps under DDP among those processes in fp32 and under a uniform plan of each
precision of the run (the step overheads are calibrated on them), and the prediction in
``summary.json`` uses them. Plans: ``fp32``, ``bf16`` (every plannable op) and ``mixed``
(every other plannable op in bf16). The fp32 and bf16 rows check the calibration (the
profile timed those very steps, minutes before the run); the mixed rows are predictions
between those ends. Beside each run, the prediction from the shipped profile alone (the
roofline for the model's ops: what a user model got before).

Targets (issue #19): median |step error| <= 10 %, max <= 25 %.

Run: ``.venv/bin/python benchmarks/user_models.py [--steps N] [--out FILE] [--models ...]
[--plans ...]``; ``--models`` may name library models (:mod:`qsync_lab.models.library`,
the ``models`` extra), which only the hook tracer traces.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from qsync_lab.cluster import load_cluster
from qsync_lab.costs import load_cost_model
from qsync_lab.graph import trace_graph
from qsync_lab.models.families import FAMILIES, family, family_batch, family_model
from qsync_lab.models.library import LIBRARY
from qsync_lab.plan import Plan
from qsync_lab.profile.overhead import uniform_op_precisions
from qsync_lab.resources import data_file
from qsync_lab.runtime.prediction import predict_plan
from reporting import finish_report, load_line

ROOT = Path(__file__).resolve().parents[1]
CLUSTER, THREADS = "local-cpu", 1
MEDIAN_TARGET_PCT, MAX_TARGET_PCT = 10.0, 25.0


PLANS = ("fp32", "mixed", "bf16")


def plans(graph) -> dict[str, dict[str, str]]:
    """``fp32``, ``mixed`` (every other op a plan may set in bf16) and ``bf16`` (all of
    them) for one model's graph."""
    bf16 = uniform_op_precisions(graph.ops, "bf16")
    return {"fp32": {}, "mixed": dict(list(bf16.items())[::2]), "bf16": bf16}


def run(name: str, plan: Plan, steps: int, folder: Path, cache: Path) -> dict:
    """One 2-rank run of ``benchmarks/train_family.py``; its summary."""
    plan_path, run_dir = folder / "plan.json", folder / f"run-{name}"
    plan.save(plan_path)
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "NUMBA_NUM_THREADS": str(THREADS),
           "QSYNC_LAB_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(ROOT / "benchmarks/train_family.py"),
                           "--family", name, "--plan", str(plan_path),
                           "--run-dir", str(run_dir), "--steps", str(steps)],
                          env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        log = Path(tempfile.gettempdir()) / f"user_models.{name}.log"
        log.write_text(done.stderr)
        raise SystemExit(f"{name}: the run failed; its output is in {log}")
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument("--models", nargs="+", default=list(FAMILIES),
                        choices=[*FAMILIES, *LIBRARY],
                        help="families and library models (the models extra) to train")
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS)
    args = parser.parse_args()
    cluster = load_cluster(CLUSTER)
    batch = cluster.ranks[0].batch_size
    shipped = load_cost_model(data_file("profiles", "cpu.csv"))
    before = load_line("before")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder) / "cache"
        cases = [(f, p) for f in args.models for p in args.plans]
        for name, plan_name in tqdm(cases, desc="runs"):
            inputs, target = family_batch(name, batch)
            graph = trace_graph(family_model(name), inputs, target=target,
                                loss_fn=family(name).loss_fn())
            plan = Plan.build(graph, cluster, {"cpu": plans(graph)[plan_name]},
                              strategy="benchmark")
            summary = run(name, plan, args.steps, Path(folder), cache)
            before = predict_plan(plan, graph, shipped, optimizer=summary["optimizer"])
            rows.append({"model": name, "plan": plan_name,
                         "traced_with": graph.traced_with,
                         "step_ms": summary["measured_step_ms"],
                         "pred_ms": summary["predicted_step_ms"],
                         "step_err_%": summary["step_error_pct"],
                         "shipped_only_err_%": 100 * (before.iteration_us / 1e3
                                                      / summary["measured_step_ms"] - 1),
                         "peak_MiB": summary["measured_tensor_peak_mib"],
                         "pred_MiB": summary["predicted_tensor_peak_mib"],
                         "mem_err_%": summary["tensor_peak_error_pct"]})
    table = pd.DataFrame(rows)
    errors = table["step_err_%"].abs()
    median, largest = statistics.median(errors), errors.max()
    mixed = table.loc[table["plan"] == "mixed", "step_err_%"]
    verdict = "MET" if median <= MEDIAN_TARGET_PCT and largest <= MAX_TARGET_PCT else "MISSED"
    report = [
        f"user-model predictions on {CLUSTER} (2 gloo ranks x {THREADS} thread, batch {batch} "
        f"each, {args.steps} steps, the first fifth warm-up); {before}",
        "pred: from the ops timed before training (cached) + the shipped profile; "
        "shipped_only: from the shipped profile alone (the roofline for these ops)", "",
        table.to_string(index=False, float_format=lambda v: f"{v:.2f}"), "",
        f"median |step error| {median:.1f} % (target <= {MEDIAN_TARGET_PCT:g} %), "
        f"max {largest:.1f} % (target <= {MAX_TARGET_PCT:g} %): {verdict}",
        *([f"of which mixed plans (predicted between the calibrated fp32 and bf16 steps): "
           f"median |step error| {statistics.median(mixed.abs()):.1f} %, max "
           f"{mixed.abs().max():.1f} %"] if len(mixed) else []),
        f"median |step error| from the shipped profile alone: "
        f"{statistics.median(table['shipped_only_err_%'].abs()):.1f} %",
        f"median |peak memory error| {statistics.median(table['mem_err_%'].abs()):.1f} %"]
    finish_report(report, args.out)


if __name__ == "__main__":
    main()
