"""The main job (``qsync-lab demo``): plan at paper scale, then plan, predict and run here.

Part 1 — the QSync paper's setting, predicted: BERT-base on 16 V100 + 16 T4, traced,
scored by the sensitivity indicator, allocated, compared with the other strategies, and
written as ``paper_plan.json`` with a Perfetto trace of its iteration.

Part 2 — the same pipeline run for real on this machine's ``local-hybrid`` cluster
(rank 0 plays a V100, rank 1 a T4, both on the CPU over gloo), for BERT-mini on the
synthetic token task: trace → profile its ops on this CPU (one thread, as each rank has)
→ indicator → allocate for a real V100 + T4 (catalog costs) → simulate → write
``plan.json`` and ``trace.json`` → train the plan on 2 local DDP ranks with torchrun →
print measured against predicted step time (the prediction of the emulated run costs each
rank from the profile just measured).
"""

import json
import os
import subprocess
import time
from pathlib import Path

import pandas as pd
import torch

from qsync_lab.allocate import allocate_detailed, compare_strategies
from qsync_lab.cluster import load_cluster
from qsync_lab.costs import CostModel
from qsync_lab.errors import QSyncError
from qsync_lab.graph import ddp_buckets, trace_graph
from qsync_lab.indicator import indicator
from qsync_lab.models import example_batch, get_model, model_spec
from qsync_lab.runtime.metrics import read_metrics
from qsync_lab.simulate import simulate

__all__ = ["LOCAL_MODEL", "run_demo"]

LOCAL_MODEL = ("bert_mini", {"seq_len": 32, "vocab_size": 2000})
LOCAL_CLUSTER = "local-hybrid"
PROFILE_PRECISIONS = ("fp32", "fp16", "int8")
LOCAL_OPTIMIZER, LOCAL_LR = "adamw", 1e-3
RUN_TIMEOUT_S = 600


def run_demo(out: "str | os.PathLike[str]" = "qsync_demo", *, model: str = "bert_base",
             cluster: str = "qsync-paper", steps: int = 30) -> dict:
    """Run both parts (see the module docstring), printing as it goes; returns the run's
    summary (``out/run/summary.json``)."""
    out = Path(out)
    _paper_scale(out, model, cluster)
    return _on_this_machine(out, steps)


def _section(title: str) -> None:
    print(f"\n== {title}", flush=True)


def _paper_scale(out: Path, name: str, cluster_name: str) -> None:
    _section(f"1. {name}: operator graph")
    model = get_model(name)
    inputs, target = example_batch(name, 2)
    begin = time.perf_counter()
    graph = trace_graph(model, inputs, target=target, loss_fn=model_spec(name).loss_fn())
    totals = graph.totals()
    print(f"{graph.num_ops} operators, {totals['param_count']:,} parameters, traced in "
          f"{time.perf_counter() - begin:.2f} s")
    print(graph.kind_summary().round(3).to_string())
    buckets = ddp_buckets(graph).groupby("bucket")["bytes"].sum() / 2**20
    print(f"DDP gradient buckets: {len(buckets)} ({', '.join(f'{mb:.1f}' for mb in buckets)} MiB)")
    cluster = load_cluster(cluster_name)
    _section(f"2. cluster {cluster.name}")
    print(cluster)
    _section("3. sensitivity indicator (2 calibration batches)")
    batches = [example_batch(name, 2, seed=s) for s in range(2)]
    scores = indicator(model, graph, batches, loss_fn=model_spec(name).loss_fn(),
                       precisions=("fp16", "int8"), num_batches=2)
    top = scores[("int8", "omega")].sort_values(ascending=False).head(5)
    print("most sensitive ops at int8: " + ", ".join(top.index))
    _section("4. strategies (catalog roofline costs)")
    costs = CostModel()
    result = allocate_detailed(graph, cluster, costs, scores)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(compare_strategies(graph, cluster, costs, scores).round(2).to_string())
    result.plan.for_model(name).save(out / "paper_plan.json")
    simulate(graph, result.plan, cluster, costs).to_perfetto(
        out / "paper_trace.json")
    print(f"QSync plan: iteration {result.iteration_us / 1e3:.1f} ms, allocated in "
          f"{result.seconds:.2f} s; wrote {out / 'paper_plan.json'}, {out / 'paper_trace.json'}")


def _on_this_machine(out: Path, steps: int) -> dict:
    from qsync_lab.profile import (fit_step_overhead, intra_op_threads, load_cost_model,
                                   profile_ops_concurrently, run_metadata,
                                   step_overhead_metadata, write_device_profile)
    from qsync_lab.resources import data_file
    from qsync_lab.runtime.launch import torchrun_command
    from qsync_lab.runtime.prediction import predict_plan
    from qsync_lab.runtime.tasks import load_task

    name, kwargs = LOCAL_MODEL
    cluster = load_cluster(LOCAL_CLUSTER)
    batch = cluster.ranks[0].batch_size
    task = load_task("tokens", name, **kwargs)
    torch.manual_seed(0)
    model = task.build_model()
    inputs, target = task.example(batch)
    _section(f"5. {name} on this machine: trace and profile (1 thread per rank)")
    graph = trace_graph(model, inputs, target=target, loss_fn=task.loss_fn())
    ranks = cluster.world_size
    rows = profile_ops_concurrently(model, inputs, target, task.loss_fn(), PROFILE_PRECISIONS,
                                    processes=ranks, threads=1, repeats=5)
    with intra_op_threads(1):
        overhead = fit_step_overhead()
    profile = out / "profile.csv"
    write_device_profile(profile, [rows], {**run_metadata("cpu", threads=1),
                                           **step_overhead_metadata(overhead),
                                           "profile_method": "in_step",
                                           "concurrent_processes": str(ranks)})
    print(f"{len(rows)} rows ({graph.num_ops} ops x {', '.join(PROFILE_PRECISIONS)} x phases, "
          f"timed inside training steps, {ranks} processes at once as the ranks will run) -> "
          f"{profile}; step overhead "
          f"{overhead.intercept:.0f} us + {overhead.slope:.1f} us per op event (fitted on "
          "calibration MLPs); casts and gloo allreduce from the shipped cpu.csv")
    _section("6. sensitivity indicator")
    scores = indicator(model, graph, [task.example(batch)], loss_fn=task.loss_fn(),
                       precisions=("fp16", "int8"), num_batches=1)
    top = scores[("fp16", "omega")].sort_values(ascending=False).head(3)
    print("most sensitive ops at fp16: " + ", ".join(top.index))
    _section("7. allocation for a real V100 + T4 (catalog costs)")
    result = allocate_detailed(graph, cluster, CostModel(), scores, optimizer=LOCAL_OPTIMIZER)
    plan = result.plan.for_model(name, kwargs)
    plan.save(out / "plan.json")
    low = {kind: n for kind, n in plan.low_precision_ops().items()}
    print(f"plan: low-precision ops per kind {low}; predicted iteration on a real V100 + T4 "
          f"{result.iteration_us / 1e3:.2f} ms (pace {result.target_us / 1e3:.2f} ms)")
    _section("8. simulate the emulated run (this CPU's profile) and write the trace")
    profiles = (str(profile), str(data_file("profiles", "cpu.csv")))
    predicted = predict_plan(plan, graph, load_cost_model(*profiles))
    predicted.to_perfetto(out / "trace.json")
    print(f"predicted step {predicted.iteration_us / 1e3:.2f} ms; wrote {out / 'plan.json'} "
          f"and {out / 'trace.json'} (open it in ui.perfetto.dev)")
    _section(f"9. train the plan on 2 local ranks ({steps} steps, torchrun, gloo)")
    run_dir = out / "run"
    command = torchrun_command(str(out / "plan.json"), cluster.world_size, runtime_args=[
        "--run-dir", str(run_dir), "--steps", str(steps), "--checkpoint-every", "0",
        "--lr", str(LOCAL_LR),
        "--threads", "1", *[arg for p in profiles for arg in ("--profile", p)]])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    if done.returncode:
        raise QSyncError(f"the training run failed (exit {done.returncode}): "
                         f"{_last_error(done.stderr)}")
    summary = json.loads((run_dir / "summary.json").read_text())
    _print_summary(summary, run_dir)
    return summary


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "Error" in line or "error" in line]
    return lines[-1].strip() if lines else "see torchrun's output"


def _print_summary(summary: dict, run_dir: Path) -> None:
    ranks = pd.DataFrame(summary["ranks"]).set_index("rank")
    ranks["low_precision_ops"] = ranks["applied_plan"].map(len)
    print(ranks[["kind", "batch_size", "low_precision_ops", "median_step_ms"]].round(2)
          .to_string())
    print(f"step time: measured {summary['measured_step_ms']:.2f} ms, predicted "
          f"{summary['predicted_step_ms']:.2f} ms ({summary['step_error_pct']:+.1f} %)")
    print(f"peak tensor memory: measured {summary['measured_tensor_peak_mib']:.1f} MiB, "
          f"predicted {summary['predicted_tensor_peak_mib']:.1f} MiB "
          f"({summary['tensor_peak_error_pct']:+.1f} %)")
    losses = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")]
    half = max(1, len(losses) // 2)
    head, tail = losses[:half], losses[-half:]
    print(f"training loss (AdamW): first half of the {summary['steps']} steps "
          f"{sum(head) / len(head):.3f}, second half {sum(tail) / len(tail):.3f} — a timing "
          "run; the tokens task takes BERT-mini many more steps to learn. Per-step metrics in "
          f"{run_dir / 'metrics.jsonl'}")
