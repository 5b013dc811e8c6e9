"""The accuracy study (issue #21): does the quantization-minimized plan train better than
uniform low precision on the slow device kind, at (nearly) the same predicted speed?

**Plans.** Every strategy is planned on the QSync paper's cluster (``qsync-paper``: 16 V100
and 16 T4, catalog costs) and its predicted throughput is read there. The planner sees
``PLAN_BATCH_PER_RANK`` samples per rank, not the paper's 32: the three models are small
enough that at 32 samples a GPU op takes microseconds, the allreduce and fixed costs decide
the step and every strategy predicts about the same speed, while at 1024 samples the T4's
compute is the bottleneck, as it is for the paper's models. (The plan is keyed by op FQNs
and weight shapes, not by batch size, so the same precisions run at any batch.) The
strategies, on the T4 (the V100 always computes in fp32):

* ``fp32``: no low precision;
* ``uniform-int8``: :func:`~qsync_lab.allocate.uniform_low_precision`, QSync's
  ``--tbitwidth 8``: every op the T4 may run in int8 in int8 (per-tensor scales,
  round-to-nearest: one scale per operand, so an outlier in an activation coarsens every
  other value), the others (norms, ...) in fp16;
* ``uniform-fp16``: the same ops, all in fp16;
* ``qsync``: the quantization-minimized plan (:meth:`qsync_lab.Study.plan`) at the
  throughput of the faster uniform plan: the least indicator risk at that speed;
* ``dynamic-batching``: all fp32, the global batch split by the ranks' fp32 speed;
* ``joint``: the least-risk precision and batch split at the same throughput target;
* ``qsync+global_qsgd:8``: the ``qsync`` plan with 8-bit Global-QSGD gradient compression.

**Runs.** Each plan's precisions per device kind and its batch split run on the
``local-hybrid`` cluster: 2 gloo ranks on this CPU, rank 0 a V100, rank 1 a T4 whose
precisions are emulated exactly, ``LOCAL_BATCH_PER_RANK`` samples per rank (the split of
``dynamic-batching``/``joint`` scaled to that global batch). One ``torchrun`` job runs every
(task, strategy, seed) in turn through :func:`qsync_lab.runtime.train` (the process group is
reused). A seed fixes the initial weights, the data (split or generation) and its order, so
the strategies of one seed form a pair. Strategies whose local plans are identical (the same
precisions, batches and compression) train once per seed; their rows name the run they share
(``same_run_as``).

**Tasks.** The digits CNN on scikit-learn's 8x8 digits, the MLP on MNIST-1D, and a 2-layer
BERT-style encoder on ``zipf_tokens`` (majority vote between two token classes with
Zipf-distributed ids: tight margins, mostly rare ids; :mod:`qsync_lab.runtime.tasks`).

**Output.** ``accuracy_study.csv``: one row per task x strategy x seed; the report
(``accuracy_study_cpu.txt``): per task mean ± std of the test accuracy over seeds, the
predicted throughput on the paper cluster and the T4's low-precision ops, then paired
t-tests over seeds (:func:`qsync_lab.accuracy.paired_tests`) of ``qsync`` against each
uniform plan.

Run: ``.venv/bin/python benchmarks/accuracy_study.py [--seeds 3] [--out-dir DIR]``; the
ranks are started by ``python -m torch.distributed.run --standalone --nproc-per-node=2
benchmarks/accuracy_study.py --worker MANIFEST``.
"""

import argparse
import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CSV_NAME = "accuracy_study.csv"
REPORT_NAME = "accuracy_study_cpu.txt"
PAPER_CLUSTER = "qsync-paper"
LOCAL_CLUSTER = "local-hybrid"
SLOW_KIND = "T4"
PLAN_BATCH_PER_RANK = 1024
LOCAL_BATCH_PER_RANK = 32
COMPRESSION = "global_qsgd:8"
REFERENCE = "qsync"
UNIFORM = ("uniform-int8", "uniform-fp16")
STRATEGIES = ("fp32", *UNIFORM, REFERENCE, "dynamic-batching", "joint",
              f"{REFERENCE}+{COMPRESSION}")
METRIC = "test_accuracy"
SEEDS = 3
#: one intra-op thread per rank (2 ranks on 2 cores); numba reads its count at import
RANK_ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}


@dataclass(frozen=True)
class TaskSetup:
    """One task of the study: a zoo model, its bundled data and how it trains."""

    model: str
    data: str
    steps: int
    optimizer: str
    lr: float
    model_kwargs: dict[str, Any] = field(default_factory=dict)


TASKS = {
    "digits_cnn": TaskSetup("digits_cnn", "digits", steps=300, optimizer="sgd_momentum",
                            lr=0.05),
    "digits_mlp": TaskSetup("digits_mlp", "mnist1d", steps=1000, optimizer="adam", lr=3e-3,
                            model_kwargs={"in_features": 40}),
    "bert_zipf": TaskSetup("bert_mini", "zipf_tokens", steps=400, optimizer="adamw", lr=3e-3,
                           model_kwargs={"num_layers": 2, "hidden": 32, "heads": 2,
                                         "intermediate": 64, "vocab_size": 129, "seq_len": 33,
                                         "dropout": 0.0}),
}


@dataclass(frozen=True)
class PlannedStrategy:
    """A strategy's plan on the paper cluster and its prediction there."""

    strategy: str
    plan: Any  # qsync_lab.plan.Plan
    throughput_samples_per_s: float


def plan_strategies(setup: TaskSetup, strategies: Sequence[str]):
    """Each of ``strategies`` planned on the paper cluster at ``PLAN_BATCH_PER_RANK`` (see the
    module docstring), with its predicted throughput there; returns the model's graph and
    strategy -> :class:`PlannedStrategy`."""
    import qsync_lab
    from qsync_lab.allocate.baselines import with_batch_sizes
    from qsync_lab.cluster import load_cluster
    from qsync_lab.plan import Plan

    paper = load_cluster(PAPER_CLUSTER)
    cluster = with_batch_sizes(paper, [PLAN_BATCH_PER_RANK] * paper.world_size)
    study = qsync_lab.Study(setup.model, cluster=cluster, model_kwargs=setup.model_kwargs,
                            optimizer=setup.optimizer, progress=False)

    def rebuilt(plan, strategy, *, precision=None, compression=None):
        ops = {kind: {fqn: precision or cfg for fqn, cfg in kind_ops.items()}
               for kind, kind_ops in plan.precisions.items()}
        return Plan.build(study.graph, plan.cluster, ops, strategy=strategy,
                          optimizer=plan.optimizer, compression=compression)

    def speed(plan):
        return study.simulate(plan).throughput_samples_per_s

    uniform = study.plan(strategy="uniform-low")
    uniforms = {"uniform-int8": rebuilt(uniform, "uniform-int8"),
                "uniform-fp16": rebuilt(uniform, "uniform-fp16", precision="fp16")}
    target = max(speed(plan) for plan in uniforms.values())
    qsync = study.plan(throughput_target=target)
    plans = {
        "fp32": study.plan(strategy="fp32"),
        **uniforms,
        REFERENCE: qsync,
        "dynamic-batching": study.plan(strategy="dynamic-batching"),
        "joint": study.plan(strategy="joint", throughput_target=target),
        f"{REFERENCE}+{COMPRESSION}": rebuilt(qsync, f"{REFERENCE}+{COMPRESSION}",
                                              compression=COMPRESSION),
    }
    return study.graph, {name: PlannedStrategy(name, plans[name], speed(plans[name]))
                         for name in strategies}


def local_batch_sizes(plan, cluster) -> tuple[int, ...]:
    """The plan's per-kind batch split scaled to ``LOCAL_BATCH_PER_RANK`` per rank of the
    local ``cluster`` (rounded; the last rank takes what rounding leaves).

    Example::

        >>> from types import SimpleNamespace as S
        >>> plan = S(ranks=[S(device="V100", batch_size=1200), S(device="T4", batch_size=848)])
        >>> local_batch_sizes(plan, S(ranks=[S(device="V100"), S(device="T4")]))
        (38, 26)
    """
    per_kind = {r.device: r.batch_size for r in plan.ranks}
    shares = [per_kind[r.device] for r in cluster.ranks]
    total = LOCAL_BATCH_PER_RANK * len(shares)
    sizes = [round(total * s / sum(shares)) for s in shares[:-1]]
    return (*sizes, total - sum(sizes))


def local_plan(planned: PlannedStrategy, graph, setup: TaskSetup):
    """The strategy's precisions per device kind and batch split on the local cluster
    (``graph``: the model's, traced at any batch size)."""
    from qsync_lab.allocate.baselines import with_batch_sizes
    from qsync_lab.cluster import load_cluster
    from qsync_lab.plan import Plan

    plan = planned.plan
    local = load_cluster(LOCAL_CLUSTER)
    local = with_batch_sizes(local, local_batch_sizes(plan, local))
    return Plan.build(graph, local, plan.precisions, strategy=planned.strategy,
                      optimizer=plan.optimizer, compression=plan.compression_settings,
                      model_name=setup.model, model_kwargs=setup.model_kwargs)


@dataclass(frozen=True)
class Run:
    """One (task, strategy, seed) row; ``same_run_as`` names the strategy whose identical
    run it shares (empty: trained itself)."""

    task: str
    strategy: str
    seed: int
    plan_path: str
    run_dir: str
    same_run_as: str = ""


def training_key(plan) -> str:
    """What a run of ``plan`` trains, as text: the plan without its strategy name and its
    explicit fp32 entries (an fp32 op is left unchanged, as an op the plan does not list)."""
    document = plan.to_dict()["_data"]
    document["strategy"] = ""
    document["precisions"] = {kind: {fqn: cfg for fqn, cfg in ops.items()
                                     if not cfg["forward"] == cfg["backward"] == "fp32"}
                              for kind, ops in document["precisions"].items()}
    return json.dumps(document, sort_keys=True)


def schedule_runs(local_plans: dict[str, dict[str, Any]], seeds: Sequence[int],
                  folder: Path) -> list[Run]:
    """One run per task, strategy and seed; a strategy whose local plan equals an earlier
    one's (but for its name) shares that run (task -> strategy -> Plan in ``local_plans``,
    saved under ``folder``)."""
    runs = []
    for task, plans in local_plans.items():
        first_with: dict[str, str] = {}
        for strategy, plan in plans.items():
            path = folder / task / f"{strategy.replace(':', '_')}.json"
            plan.save(path)
            shared = first_with.setdefault(training_key(plan), strategy)
            for seed in seeds:
                trained_by = shared if shared != strategy else ""
                run_dir = folder / task / f"{(trained_by or strategy).replace(':', '_')}-{seed}"
                runs.append(Run(task, strategy, seed, str(path), str(run_dir), trained_by))
    return runs


# ----------------------------------------------------------------------------- the ranks


def worker(manifest: Path) -> None:
    """Every rank: train each run of the manifest in turn on the one process group, each
    task's data loaded once per seed. Rank 0 shows a bar over the runs on stdout; each
    run's own step bar is silenced, and stderr (the profiler's and torchrun's chatter, a
    failed run's traceback) goes to the log."""
    import torch
    import torch.distributed as dist
    from tqdm.auto import tqdm

    from qsync_lab.io import atomic_write_text
    from qsync_lab.runtime.tasks import load_task
    from qsync_lab.runtime.trainer import TrainConfig, train

    loaded = {}

    def task_of(job):
        key = (job["task"], job["seed"])
        if key not in loaded:
            setup = TASKS[job["task"]]
            loaded[key] = load_task(setup.data, setup.model, seed=job["seed"],
                                    **setup.model_kwargs)
        return loaded[key]

    torch.set_num_threads(1)
    jobs = json.loads(manifest.read_text())
    dist.init_process_group("gloo")
    try:
        bar = tqdm(jobs, desc="accuracy study", unit="run", file=sys.stdout,
                   disable=dist.get_rank() != 0)
        for job in bar:
            bar.set_postfix_str(f"{job['task']} {job['strategy']} seed {job['seed']}")
            start = time.perf_counter()
            captured = io.StringIO()
            try:
                with contextlib.redirect_stderr(captured):
                    train(TrainConfig(**job["config"]), task=task_of(job))
            except BaseException:
                sys.stderr.write(captured.getvalue())
                raise
            if dist.get_rank() == 0:
                atomic_write_text(Path(job["config"]["run_dir"]) / "wall_s.json",
                                  json.dumps(time.perf_counter() - start) + "\n")
    finally:
        dist.destroy_process_group()


def train_runs(runs: Sequence[Run], setups: dict[str, TaskSetup], folder: Path) -> None:
    """Start one torchrun job of 2 ranks that trains every run not shared with another."""
    from qsync_lab.io import atomic_write_text

    jobs = [{"task": r.task, "strategy": r.strategy, "seed": r.seed, "config": {
        "plan": r.plan_path, "run_dir": r.run_dir,
        "steps": setups[r.task].steps, "optimizer": setups[r.task].optimizer,
        "lr": setups[r.task].lr, "seed": r.seed, "checkpoint_every": 0}}
        for r in runs if not r.same_run_as]
    manifest = folder / "manifest.json"
    atomic_write_text(manifest, json.dumps(jobs, indent=1))
    log = folder / "torchrun.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", str(Path(__file__).resolve()), "--worker", str(manifest)]
    with log.open("w") as errors:
        done = subprocess.run(command, env={**os.environ, **RANK_ENV}, stderr=errors,
                              check=False)
    if done.returncode:
        tail = log.read_text().splitlines()[-15:]
        raise SystemExit(f"the training job failed ({done.returncode}); {log}:\n"
                         + "\n".join(tail))


# ----------------------------------------------------------------------------- results


def result_rows(runs: Sequence[Run], setups: dict[str, TaskSetup],
                planned: dict[str, dict[str, PlannedStrategy]],
                local_plans: dict[str, dict[str, Any]]) -> "pd.DataFrame":
    """One row per run: the run's test metrics and local batches, the plan's prediction on
    the paper cluster and its low-precision ops."""
    import pandas as pd

    rows = []
    for r in runs:
        summary = json.loads((Path(r.run_dir) / "summary.json").read_text())
        plan = planned[r.task][r.strategy].plan
        t4_ops = plan.precisions[SLOW_KIND].values()
        local = local_plans[r.task][r.strategy]
        rows.append({
            "task": r.task, "model": setups[r.task].model, "data": setups[r.task].data,
            "strategy": r.strategy, "seed": r.seed,
            "test_accuracy": summary["test_accuracy"], "test_loss": summary["test_loss"],
            "paper_throughput_samples_per_s":
                planned[r.task][r.strategy].throughput_samples_per_s,
            "t4_low_precision_ops": sum(not cfg.is_fp32 for cfg in t4_ops),
            "t4_int8_ops": sum(str(cfg.forward) == "int8" for cfg in t4_ops),
            "local_batches": "/".join(str(b) for b in local.batch_sizes),
            "compression": str(local.compression_settings) or "none",
            "steps": summary["steps"], "optimizer": summary["optimizer"],
            "local_step_ms": summary["measured_step_ms"],
            "same_run_as": r.same_run_as,
        })
    return pd.DataFrame(rows)


def report_lines(frame: "pd.DataFrame", strategies: Sequence[str]) -> list[str]:
    """The per-task table and, where both sides ran, the paired tests."""
    from qsync_lab.accuracy import paired_tests, summary_table

    plan_columns = ["paper_throughput_samples_per_s", "t4_low_precision_ops", "t4_int8_ops",
                    "local_batches", "same_run_as"]
    table = summary_table(frame, METRIC, plan_columns=plan_columns)
    loss = summary_table(frame, "test_loss")
    table.insert(3, "test_loss_mean", loss["mean"])
    table["paper_throughput_samples_per_s"] = table["paper_throughput_samples_per_s"].round(-3)
    table = table.rename(columns={"mean": "acc_mean", "std": "acc_std",
                                  "paper_throughput_samples_per_s": "paper_samples_per_s"})
    lines = ["", f"test accuracy over seeds (mean, sample std), test loss; predicted "
             f"throughput on {PAPER_CLUSTER} at {PLAN_BATCH_PER_RANK} samples per rank:",
             table.to_string()]
    against = [s for s in UNIFORM if s in strategies]
    if REFERENCE in strategies and against and frame["seed"].nunique() >= 2:
        tests = paired_tests(frame, METRIC, reference=REFERENCE, against=against,
                             throughput="paper_throughput_samples_per_s")
        lines += ["", f"paired t-tests over seeds of {REFERENCE} against each uniform plan "
                  f"(difference = {REFERENCE} minus the other; claim: {REFERENCE}'s mean >= "
                  "the other's at >= 99 % of its predicted throughput):",
                  tests.round(4).to_string()]
        n = int(tests["n"].min())
        lines.append(f"with {n} seeds a paired t-test has low power: 'within noise' means the "
                     "seeds could not tell the strategies apart, not that they are equal")
    return lines


def main(argv: Sequence[str] | None = None) -> "pd.DataFrame":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--seeds", type=int, default=SEEDS)
    parser.add_argument("--steps", type=int, help="override every task's steps (smoke runs)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.worker:
        from qsync_lab.runtime.rank_exit import exit_rank

        worker(args.worker)
        exit_rank()  # a finished gloo worker may abort in the interpreter's teardown
    from qsync_lab.io import atomic_write_text
    from reporting import load_line

    began = time.perf_counter()
    setups = {name: TASKS[name] for name in args.tasks.split(",")}
    if args.steps:
        setups = {n: dataclasses.replace(s, steps=args.steps) for n, s in setups.items()}
    strategies = args.strategies.split(",")
    report = [f"accuracy study: {len(setups)} tasks x {len(strategies)} strategies x "
              f"{args.seeds} seeds on {LOCAL_CLUSTER} (2 gloo ranks, rank 1 an emulated "
              f"{SLOW_KIND}, {LOCAL_BATCH_PER_RANK} samples per rank)", load_line("before")]
    planned, local_plans = {}, {}
    for task, setup in setups.items():
        graph, planned[task] = plan_strategies(setup, strategies)
        local_plans[task] = {s: local_plan(p, graph, setup) for s, p in planned[task].items()}
    planned_s = time.perf_counter() - began
    with tempfile.TemporaryDirectory(prefix="accuracy_study_") as tmp:
        runs = schedule_runs(local_plans, range(args.seeds), Path(tmp))
        train_runs(runs, setups, Path(tmp))
        frame = result_rows(runs, setups, planned, local_plans)
    trained = sum(not r.same_run_as for r in runs)
    report += report_lines(frame, strategies)
    report += ["", f"wall time {time.perf_counter() - began:.0f} s: planning {planned_s:.0f} s, "
               f"{trained} of {len(runs)} runs trained (the others share an identical plan's "
               "run)", load_line("after")]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out_dir / CSV_NAME, frame.to_csv(index=False))
    atomic_write_text(args.out_dir / REPORT_NAME, "\n".join(report) + "\n")
    print("\n".join(report))
    return frame


if __name__ == "__main__":
    main()
