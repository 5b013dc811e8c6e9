"""The main job (``qsync-lab demo``): plan at paper scale, then plan, predict and run here.

Part 1 — the QSync paper's setting, predicted: BERT-base on 16 V100 + 16 T4, traced,
scored by the sensitivity indicator, allocated, compared with the other strategies, and
written as ``paper_plan.json`` with a Perfetto trace of its iteration and an HTML report
(``paper_report.html``: summary, strategies, figures; it opens offline).

Part 2 — the same pipeline run for real on this machine's ``local-hybrid`` cluster
(rank 0 plays a V100, rank 1 a T4, both on the CPU over gloo), for BERT-mini on the
synthetic token task: trace → indicator → allocate for a real V100 + T4 (catalog costs) →
profile its ops on this CPU (one thread per rank, both ranks at once) → predict the
emulated run → write ``plan.json`` and ``trace.json`` → train the plan on 2 local DDP
ranks → print measured against predicted step time and memory. Both parts go through
:class:`~qsync_lab.study.Study`.
"""

import os
import time
from pathlib import Path

import pandas as pd

from qsync_lab.cluster import load_cluster
from qsync_lab.graph import ddp_buckets
from qsync_lab.report import write_report
from qsync_lab.study import Study

__all__ = ["LOCAL_MODEL", "run_demo"]

LOCAL_MODEL = ("bert_mini", {"seq_len": 32, "vocab_size": 2000})
LOCAL_CLUSTER = "local-hybrid"
#: a larger step error is explained from the measurement itself
STEP_ERROR_BOUND_PCT = 5.0
LOCAL_OPTIMIZER, LOCAL_LR = "adamw", 1e-3


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
    study = Study(name, cluster=cluster_name)
    _section(f"1. {name}: operator graph")
    begin = time.perf_counter()
    graph = study.graph
    totals = graph.totals()
    print(f"{graph.num_ops} operators, {totals['param_count']:,} parameters, traced in "
          f"{time.perf_counter() - begin:.2f} s")
    print(graph.kind_summary().round(3).to_string())
    buckets = ddp_buckets(graph).groupby("bucket")["bytes"].sum() / 2**20
    print(f"DDP gradient buckets: {len(buckets)} ({', '.join(f'{mb:.1f}' for mb in buckets)} MiB)")
    _section(f"2. cluster {study.cluster.name}")
    print(study.cluster)
    _section(f"3. sensitivity indicator ({study.calibration_batches} calibration batches)")
    top = study.indicator()[("int8", "risk")].sort_values(ascending=False).head(5)
    print("most sensitive ops at int8: " + ", ".join(top.index))
    _section("4. strategies (catalog roofline costs)")
    comparison = study.compare()
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(comparison.round(2).to_string())
    begin = time.perf_counter()
    plan = study.plan()
    seconds = time.perf_counter() - begin
    plan.save(out / "paper_plan.json")
    sim = study.simulate(plan)
    sim.write_perfetto(out / "paper_trace.json")
    report = write_report(plan, out / "paper_report.html", study=study, comparison=comparison)
    print(f"QSync plan: iteration {sim.iteration_us / 1e3:.1f} ms, allocated in {seconds:.2f} s;"
          f" wrote {out / 'paper_plan.json'}, {out / 'paper_trace.json'} and the report "
          f"{report} (open it in a browser)")


def _on_this_machine(out: Path, steps: int) -> dict:
    name, kwargs = LOCAL_MODEL
    cluster = load_cluster(LOCAL_CLUSTER)
    study = Study(name, cluster=cluster, model_kwargs=kwargs, optimizer=LOCAL_OPTIMIZER,
                  batch_size=cluster.ranks[0].batch_size, calibration_batches=1)
    _section(f"5. {name} on this machine: trace")
    print(f"{study.graph.num_ops} operators; {study.cluster}")
    _section("6. sensitivity indicator")
    top = study.indicator()[("fp16", "risk")].sort_values(ascending=False).head(3)
    print("most sensitive ops at fp16: " + ", ".join(top.index))
    _section("7. allocation for a real V100 + T4 (catalog costs)")
    plan = study.plan()
    plan.save(out / "plan.json")
    sim = study.simulate(plan)
    print(f"plan: low-precision ops per kind {plan.low_precision_ops()}; predicted iteration "
          f"on a real V100 + T4 {sim.iteration_us / 1e3:.2f} ms")
    _section("8. profile this CPU (one thread per rank, both ranks at once) and predict the run")
    print(study.profile(out / "profile.csv"))
    predicted = study.predict_run(plan)
    predicted.write_perfetto(out / "trace.json")
    print(f"predicted step {predicted.iteration_us / 1e3:.2f} ms (ops from the profile just "
          f"measured, casts and gloo links from the shipped cpu.csv); wrote "
          f"{out / 'plan.json'} and {out / 'trace.json'} (open it in ui.perfetto.dev)")
    _section(f"9. train the plan on 2 local ranks ({steps} steps, torchrun, gloo)")
    summary = study.run(plan, steps=steps, run_dir=out / "run", lr=LOCAL_LR,
                        checkpoint_every=0)
    _print_summary(summary, out / "run")
    return summary


def _explain_step_error(summary: dict, records: list[dict]) -> None:
    """What the measurement itself says when the prediction misses by more than the bound."""
    timed = sorted(max(r["step_ms"]) for r in records[summary["warmup_steps"]:])
    low, high = timed[len(timed) // 4], timed[(3 * len(timed)) // 4]
    median = summary["measured_step_ms"]
    load = os.getloadavg()[0]
    print(f"the step error is over {STEP_ERROR_BOUND_PCT:g} %: the timed steps' middle half "
          f"spans {low:.1f}-{high:.1f} ms ({100 * (high - low) / median:.0f} % of the median) "
          f"and the 1-min load average is {load:.2f} on {os.cpu_count()} cores (the prediction "
          "assumes the ranks have the cores to themselves, as when the profile was taken; "
          "benchmarks/results/predictor_accuracy_cpu.txt has the predictor on a quiet machine)")


def _print_summary(summary: dict, run_dir: Path) -> None:
    from qsync_lab.runtime.metrics import read_metrics

    ranks = pd.DataFrame(summary["ranks"]).set_index("rank")
    ranks["low_precision_ops"] = ranks["applied_plan"].map(len)
    print(ranks[["kind", "batch_size", "low_precision_ops", "median_step_ms"]].round(2)
          .to_string())
    print(f"step time: measured {summary['measured_step_ms']:.2f} ms, predicted "
          f"{summary['predicted_step_ms']:.2f} ms ({summary['step_error_pct']:+.1f} %), median "
          f"of {summary['timed_steps']} steps after {summary['warmup_steps']} warm-up steps")
    print(f"peak tensor memory: measured {summary['measured_tensor_peak_mib']:.1f} MiB, "
          f"predicted {summary['predicted_tensor_peak_mib']:.1f} MiB "
          f"({summary['tensor_peak_error_pct']:+.1f} %)")
    records = read_metrics(run_dir / "metrics.jsonl")
    if abs(summary["step_error_pct"]) > STEP_ERROR_BOUND_PCT:
        _explain_step_error(summary, records)
    losses = [r["loss"] for r in records]
    half = max(1, len(losses) // 2)
    head, tail = losses[:half], losses[-half:]
    print(f"training loss ({summary['optimizer']}): first half of the {summary['steps']} steps "
          f"{sum(head) / len(head):.3f}, second half {sum(tail) / len(tail):.3f} — a timing "
          "run; the tokens task takes BERT-mini many more steps to learn. Per-step metrics in "
          f"{run_dir / 'metrics.jsonl'}")
