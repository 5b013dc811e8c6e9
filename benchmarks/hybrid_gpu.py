"""QSync's experiment on one GPU: a fast partition and a slow one, each plan measured.

The GPU is split into two ranks with green contexts (``sms``, run at once under MPS, over
gloo): a fast rank on most of its SMs and a slow rank on ``--slow-sms`` of them. For each
model (BERT-base by default) the strategies ``fp32``, ``uniform-low`` (the slow rank's ops
at its lowest precision), ``dynamic-batching`` and ``qsync`` (the allocator: the least
quantization of the slow rank that keeps it in step with the fast one at fp32) are planned
by :class:`qsync_lab.Study` and trained with ``qsync-lab run``'s launcher for ``--steps``
steps per seed. A row gives the measured step and throughput beside the predicted ones,
the predicted idle time of each rank, and the training loss at the last step.

Without a GPU it refuses in one line; ``--dry-run`` writes the cluster file and the plans
with their predictions only (what CI checks).

Example (``benchmarks/gpu_check.sh hybrid`` runs the first)::

    python benchmarks/hybrid_gpu.py --steps 30 --out $OUT
    python benchmarks/hybrid_gpu.py --models bert_base,resnet50 --seeds 0,1,2 --profile gpu.csv
    python benchmarks/hybrid_gpu.py --dry-run --kind H100-SXM5-80GB --models bert_mini
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import pandas as pd

STRATEGIES = ("fp32", "uniform-low", "dynamic-batching", "qsync")
MODEL_KWARGS = {"bert_base": {"seq_len": 128}, "bert_mini": {"seq_len": 32, "vocab_size": 2000}}
COLUMNS = ["model", "strategy", "seed", "status", "step_ms", "pred_step_ms", "err_pct",
           "samples_per_s", "pred_samples_per_s", "pred_idle_fast_ms", "pred_idle_slow_ms",
           "slow_low_precision_ops", "final_loss"]


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


def measure(study, plan, prediction: dict, seed: int, steps: int, run_dir: Path) -> dict:
    """Train ``plan`` for ``steps`` steps (seed ``seed``); the row, or a failed one."""
    from qsync_lab.errors import QSyncError

    row = {**prediction, "seed": seed}
    try:
        summary = study.run(plan, steps=steps, run_dir=run_dir, seed=seed)
    except QSyncError as err:
        return {**row, "status": f"failed: {str(err).splitlines()[0][:160]}"}
    step_ms = summary["measured_step_ms"]
    return {**row, "status": "ok", "step_ms": step_ms,
            "err_pct": 100 * (prediction["pred_step_ms"] - step_ms) / step_ms,
            "samples_per_s": 1e3 * plan.cluster.global_batch_size / step_ms,
            "final_loss": final_loss(run_dir)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert_base")
    parser.add_argument("--slow-sms", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch (32)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (3 for the loss)")
    parser.add_argument("--profile", action="append", default=[], help="GPU profile CSV")
    parser.add_argument("--kind", help="catalog kind (default: this GPU's)")
    parser.add_argument("--dry-run", action="store_true", help="plans and predictions only")
    parser.add_argument("--out", type=Path, default=Path("gpu_out"))
    args = parser.parse_args(argv)

    from qsync_lab import Study
    from qsync_lab.devices import load_catalog

    kind, total = ((load_catalog().device(args.kind).name, load_catalog().device(args.kind)
                    .sm_count) if args.kind else gpu_kind())
    args.out.mkdir(parents=True, exist_ok=True)
    cluster = args.out / "hybrid_cluster.toml"
    cluster.write_text(cluster_text(kind, total, args.slow_sms, args.batch))
    rows = []
    for model in args.models.split(","):
        study = Study(model, cluster=cluster, model_kwargs=MODEL_KWARGS.get(model),
                      profiles=tuple(args.profile), progress=False)
        for strategy in STRATEGIES:
            plan, prediction = plan_row(study, model, strategy)
            plan.save(args.out / f"hybrid_{model}_{strategy}.json")
            for seed in map(int, args.seeds.split(",")):
                run_dir = args.out / f"hybrid_{model}_{strategy}_{seed}"
                rows.append({**prediction, "seed": seed, "status": "planned"} if args.dry_run
                            else measure(study, plan, prediction, seed, args.steps, run_dir))
                table = pd.DataFrame(rows, columns=COLUMNS)
                table.to_csv(args.out / "hybrid_gpu.csv", index=False, float_format="%.3f")
    print(f"{kind}: {total - args.slow_sms} + {args.slow_sms} SMs, batch {args.batch} per rank, "
          f"{args.steps} steps")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    losses = table.dropna(subset=["final_loss"]).groupby("strategy")["final_loss"]
    for strategy, values in losses:
        print(f"{strategy}: final loss {statistics.fmean(values):.4f} over {len(values)} seeds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
