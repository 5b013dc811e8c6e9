"""QSync's experiment on one GPU: a fast partition and a slow one, each plan measured.

The GPU is split into two ranks with green contexts (``sms``, run at once under MPS, over
gloo): a fast rank on most of its SMs and a slow rank on ``--slow-sms`` of them. For each
model (BERT-base by default) the strategies ``fp32``, ``qsync`` (the allocator: the least
quantization of the slow rank that keeps it in step with the fast one at fp32),
``uniform-low`` (the slow rank's ops at its lowest precision) and ``dynamic-batching`` are
planned by :class:`qsync_lab.Study` and trained with ``qsync-lab run``'s launcher for
``--steps`` steps per seed. A row gives the measured step and throughput beside the
predicted ones, the predicted idle time of each rank, and the training loss at the last step.

On a GPU it first prints what the run depends on (torch, green contexts, cuda-python, the MPS
control program), starts MPS for all the rows and runs two probe processes on the partitions
at once; where MPS cannot start or its processes fail, the ranks take turns on the GPU
(``QSYNC_MPS=off``), as the output and the table's ``sharing`` column say. The table is
rewritten after every row (``<out>/hybrid_gpu.csv`` and ``.txt``); a row that fails keeps
its prediction and its error's last line, and rows that would start past ``--budget-s``
seconds are skipped (a row still running then is stopped). Without a GPU it refuses in one
line; ``--dry-run`` writes the cluster file and the plans with their predictions only (what
CI checks).

Example (``benchmarks/gpu_check.sh hybrid`` runs the first)::

    python benchmarks/hybrid_gpu.py --steps 30 --out $OUT
    python benchmarks/hybrid_gpu.py --models bert_base,resnet50 --seeds 0,1,2 --profile gpu.csv
    python benchmarks/hybrid_gpu.py --dry-run --kind H100-SXM5-80GB --models bert_mini
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pandas as pd

STRATEGIES = ("fp32", "qsync", "uniform-low", "dynamic-batching")  # the pair that matters first
MODEL_KWARGS = {"bert_base": {"seq_len": 128}, "bert_mini": {"seq_len": 32, "vocab_size": 2000}}
COLUMNS = ["model", "strategy", "seed", "status", "step_ms", "pred_step_ms", "err_pct",
           "samples_per_s", "pred_samples_per_s", "pred_idle_fast_ms", "pred_idle_slow_ms",
           "slow_low_precision_ops", "final_loss", "sharing", "granted_sms", "row_s"]
FIRST_ROW_S = 45.0  # a row's seconds (BERT-base) before one has run: start, build, steps, save
PROBE_S = 60.0
# a probe: this process on its share of GPU 0 (gpu_share.enter_sm_partition), one kernel
PROBE = """import json, sys, torch
from qsync_lab.runtime.gpu_share import enter_sm_partition
torch.cuda.set_device(0)
granted = enter_sm_partition(json.loads(sys.argv[1]), int(sys.argv[2]), 0)
x = torch.ones(1024, 1024, device="cuda")
assert float((x @ x)[0, 0]) == 1024
print(json.dumps(granted))
"""


class Stopped(BaseException):
    """The budget ran out (SIGALRM) or the step's ``timeout`` stopped this script (SIGINT,
    SIGTERM)."""


def _stop(signum, _frame):
    raise Stopped(signal.Signals(signum).name)


def cluster_text(kind: str, total_sms: int, slow_sms: int, batch_size: int) -> str:
    """A one-node cluster of two ranks on one GPU: ``total - slow`` SMs and ``slow`` SMs.

    Example::

        >>> print(cluster_text("H100-SXM5-80GB", 132, 16, 32).splitlines()[-3])
            { kind = "H100-SXM5-80GB", count = 1, sms = 116 },
    """
    return (f'name = "one-gpu-{total_sms - slow_sms}-{slow_sms}"\n'
            f'description = "one {kind}: {total_sms - slow_sms} + {slow_sms} SMs"\n'
            f"batch_size = {batch_size}\n\n[[node]]\nname = \"gpu0\"\n"
            'intra_node_link = "loopback"\ndevices = [\n'
            f'    {{ kind = "{kind}", count = 1, sms = {total_sms - slow_sms} }},\n'
            f'    {{ kind = "{kind}", count = 1, sms = {slow_sms} }},\n]\n')


def gpu_kind() -> tuple[str, int]:
    """This machine's GPU as (catalog kind, SM count); a one-line exit without one."""
    import torch

    from qsync_lab.profile.device import profile_device_name

    if not torch.cuda.is_available():
        sys.exit("hybrid_gpu.py: no CUDA GPU here; run it on a GPU machine, or --dry-run "
                 "--kind KIND for the plans and predictions only")
    return profile_device_name("cuda"), torch.cuda.get_device_properties(0).multi_processor_count


def preflight(kind: str, total_sms: int) -> None:
    """Print what the partitioned run depends on, so that its log explains a failure."""
    import torch

    from qsync_lab.runtime.gpu_share import mps_control, mps_running

    try:
        from torch.cuda.green_contexts import GreenContext
        green = f"yes (GreenContext.Stream: {'yes' if hasattr(GreenContext, 'Stream') else 'no'})"
    except ImportError:
        green = "no"
    try:
        from cuda import bindings
        carve = f"cuda.bindings {bindings.__version__} (disjoint partitions)"
    except ImportError:
        carve = "no cuda.bindings (torch's green contexts: the partitions overlap)"
    control = mps_control()
    server = control and shutil.which("nvidia-cuda-mps-server", path=str(Path(control).parent))
    settings = {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS_")}
    print(f"preflight: torch {torch.__version__} (CUDA {torch.version.cuda}); {kind}, "
          f"{total_sms} SMs; torch.cuda.green_contexts: {green}; {carve}; MPS control: "
          f"{control or 'absent'}, server: {server or 'absent'}, running: {mps_running()}; "
          f"{settings or 'no CUDA_MPS_* settings'}", flush=True)


def probe(shares: list[int]) -> tuple[str | None, str | None]:
    """Run one process on each share of GPU 0 at once (:data:`PROBE`): ``(SMs granted,
    None)``, e.g. ``("116+16", None)`` (``?``: torch's green contexts do not say), or
    ``(None, the first failure's last line)``."""
    jobs = [subprocess.Popen([sys.executable, "-c", PROBE, json.dumps(shares), str(position)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for position in range(len(shares))]
    deadline, granted, errors = time.monotonic() + PROBE_S, [], []
    for job in jobs:
        try:
            out, err = job.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            job.kill()
            out, err = job.communicate()
            err += f"\nno answer in {PROBE_S:.0f} s"
        lines = [line for line in err.splitlines() if line.strip()]
        for note in (line for line in lines if line.startswith("qsync_lab: ")):
            print(note, flush=True)  # a partition that torch made (overlapping)
        if job.returncode or not out.strip():
            errors.append(lines[-1] if lines else f"exit {job.returncode}")
        else:
            granted.append(json.loads(out.splitlines()[-1]))
    if errors:
        return None, errors[0]
    return "+".join("?" if g is None else str(g) for g in granted), None


def share_gpu(mps: contextlib.ExitStack, shares: list[int]) -> tuple[str, str]:
    """Start MPS for the rows (``mps`` stops it) and probe the partitions under it; where MPS
    cannot start or its processes fail, the ranks take turns (``QSYNC_MPS=off``). Returns
    ``(sharing, SMs granted)``, e.g. ``("mps (started)", "116+16")``.

    Raises:
        QSyncError: the partitions fail without MPS too.
    """
    from qsync_lab.errors import QSyncError
    from qsync_lab.runtime.gpu_share import MPS_ENV, mps_daemon

    try:
        how = mps.enter_context(mps_daemon([0]))
    except QSyncError as err:
        print(f"MPS: {err}; the ranks take turns on the GPU instead", flush=True)
    else:
        granted, error = probe(shares)
        if error is None:
            return f"mps ({how})", granted
        print(f"the partitions fail under MPS ({error}): stopping it; the ranks take turns "
              "on the GPU instead", flush=True)
        mps.close()
    os.environ[MPS_ENV] = "off"
    granted, error = probe(shares)
    if error is not None:
        raise QSyncError(f"the partitions fail without MPS too: {error}")
    return "time-sliced (no MPS)", granted


def final_loss(run_dir: Path) -> float | None:
    """The loss of the last step in ``run_dir/metrics.jsonl``."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1]).get("loss") if lines else None


def plan_row(study, model: str, strategy: str) -> tuple[object, dict]:
    """The strategy's plan and the prediction columns of its rows."""
    plan = study.plan(strategy=strategy)
    sim = study.simulate(plan)
    idle = sim.idle_us.to_numpy() / 1e3
    slow_kind = plan.cluster.ranks[1].device
    return plan, {"model": model, "strategy": strategy, "pred_step_ms": sim.iteration_us / 1e3,
                  "pred_samples_per_s": sim.throughput_samples_per_s, "pred_idle_fast_ms": idle[0],
                  "pred_idle_slow_ms": idle[1],
                  "slow_low_precision_ops": plan.low_precision_ops().get(slow_kind, 0)}


def planned_rows(args, cluster: Path) -> list[tuple[object, dict]]:
    """``(study and plan, row)`` per model, strategy and seed, the row holding the prediction
    (a strategy that fails to plan: no plan, its rows failed with the error's last line)."""
    from qsync_lab import Study

    rows = []
    for model in args.models.split(","):
        study = Study(model, cluster=cluster, model_kwargs=MODEL_KWARGS.get(model),
                      profiles=tuple(args.profile), progress=False)
        for strategy in STRATEGIES:
            try:
                plan, row = plan_row(study, model, strategy)
                plan.save(args.out / f"hybrid_{model}_{strategy}.json")
            except Exception as err:
                plan, row = None, {"model": model, "strategy": strategy,
                                   "status": f"failed: {_last_line(err)}"}
            rows += [((study, plan), {**row, "seed": seed}) for seed in args.seeds]
    return rows


def measure(study, plan, row: dict, steps: int, run_dir: Path) -> dict:
    """Train ``plan`` for ``steps`` steps (seed ``row["seed"]``): the row, or a failed one."""
    try:
        summary = study.run(plan, steps=steps, run_dir=run_dir, seed=row["seed"],
                            checkpoint_every=0)
        step_ms = summary["measured_step_ms"]
        return {**row, "status": "ok", "step_ms": step_ms,
                "err_pct": 100 * (row["pred_step_ms"] - step_ms) / step_ms,
                "samples_per_s": 1e3 * plan.cluster.global_batch_size / step_ms,
                "final_loss": final_loss(run_dir)}
    except Exception as err:  # one failed row never stops the others
        return {**row, "status": f"failed: {_last_line(err)}"}


def _last_line(err: BaseException) -> str:
    return traceback.format_exception_only(err)[-1].strip()


def write(out: Path, header: str, rows: list[dict]) -> pd.DataFrame:
    """The table so far, in ``out/hybrid_gpu.csv`` and ``.txt`` (the header first there)."""
    table = pd.DataFrame(rows).reindex(columns=COLUMNS)
    table.to_csv(out / "hybrid_gpu.csv", index=False, float_format="%.3f")
    text = table.to_string(index=False, float_format=lambda v: f"{v:.2f}")
    (out / "hybrid_gpu.txt").write_text(f"{header}\n{text}\n")
    return table


def main(argv: list[str] | None = None) -> int:
    begin = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert_base")
    parser.add_argument("--slow-sms", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch (32)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (3 for the loss)")
    parser.add_argument("--profile", action="append", default=[], help="GPU profile CSV")
    parser.add_argument("--kind", help="catalog kind (default: this GPU's)")
    parser.add_argument("--dry-run", action="store_true", help="plans and predictions only")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="rows that would end past this many seconds are skipped, and one "
                        "still running then is stopped (200: gpu_check.sh gives 240)")
    parser.add_argument("--out", type=Path, default=Path("gpu_out"))
    args = parser.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",")]

    from qsync_lab.devices import load_catalog

    if args.kind:
        spec = load_catalog().device(args.kind)
        kind, total = spec.name, spec.sm_count
    else:
        kind, total = gpu_kind()
        preflight(kind, total)
    args.out.mkdir(parents=True, exist_ok=True)
    cluster = args.out / "hybrid_cluster.toml"
    cluster.write_text(cluster_text(kind, total, args.slow_sms, args.batch))
    shares = [total - args.slow_sms, args.slow_sms]
    header = (f"# benchmarks/hybrid_gpu.py: {kind}, {shares[0]} + {shares[1]} SMs, batch "
              f"{args.batch} per rank, {args.steps} steps")
    if args.dry_run:
        table = write(args.out, header, [{**row, "status": row.get("status", "planned")}
                                         for _, row in planned_rows(args, cluster)])
    else:
        table = run_rows(args, cluster, shares, header, deadline=begin + args.budget_s)
    print("\n" + (args.out / "hybrid_gpu.txt").read_text(), end="")
    losses = table.dropna(subset=["final_loss"]).groupby("strategy")["final_loss"]
    for strategy, values in losses:
        print(f"{strategy}: final loss {statistics.fmean(values):.4f} over {len(values)} seeds")
    print(f"wrote {args.out / 'hybrid_gpu.csv'} and .txt")
    return 0 if args.dry_run or (table["status"] == "ok").any() else 1


def run_rows(args, cluster: Path, shares: list[int], header: str, *,
             deadline: float) -> pd.DataFrame:
    """Measure every planned row on the GPU, MPS running (or the ranks taking turns), the
    table written after each; at ``deadline`` (or on SIGINT, SIGTERM) the row running is
    stopped and the rest skipped. No partitions at all: one failed row that says why."""
    from qsync_lab.errors import QSyncError

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
        signal.signal(signum, _stop)
    signal.alarm(max(1, round(deadline - time.monotonic())))
    rows: list[dict] = []
    try:
        with contextlib.ExitStack() as mps:
            sharing, granted = share_gpu(mps, shares)
            header += f"; {sharing}, SMs granted {granted}"
            print(header, flush=True)
            measure_rows(args, planned_rows(args, cluster), rows, header, deadline,
                         {"sharing": sharing, "granted_sms": granted})
    except QSyncError as err:  # the partitions fail: nothing to measure
        rows.append({"status": f"failed: {err}", "sharing": "none"})
    except Stopped as why:  # while probing, planning or stopping MPS: the rows written stay
        print(f"stopped ({why}) outside a row", flush=True)
    finally:
        signal.alarm(0)
    return write(args.out, header, rows)


def measure_rows(args, planned: list, rows: list[dict], header: str, deadline: float,
                 sharing: dict) -> None:
    """Add each planned row to ``rows``, measured (or failed, stopped or skipped), and
    rewrite the table after each."""
    took: list[float] = []  # the seconds of each row measured
    skip = None  # why the rows left are skipped
    for (study, plan), row in planned:
        row = {**row, **sharing}
        if skip is None and time.monotonic() + max(took, default=FIRST_ROW_S) > deadline:
            skip = f"skipped: --budget-s {args.budget_s:.0f} spent"
        if plan is None or skip:
            rows.append({**row, "status": row.get("status", skip)})
            write(args.out, header, rows)
            continue
        started = time.monotonic()
        run_dir = args.out / f"hybrid_{row['model']}_{row['strategy']}_{row['seed']}"
        try:
            row = measure(study, plan, row, args.steps, run_dir)
        except Stopped as why:
            row, skip = {**row, "status": f"stopped: {why}"}, f"skipped: stopped ({why})"
        took.append(time.monotonic() - started)
        rows.append({**row, "row_s": took[-1]})
        write(args.out, header, rows)
        print(f"{row['model']} {row['strategy']} seed {row['seed']}: {row['status']}, step "
              f"{row.get('step_ms', float('nan')):.1f} ms (predicted {row['pred_step_ms']:.1f}), "
              f"{took[-1]:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
