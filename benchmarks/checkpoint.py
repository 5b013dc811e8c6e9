"""Checkpoint write and verify time beside the step time (issue #23).

For the digits CNN (bundled digits task, batch 32) and ResNet-18 (synthetic images, batch 16),
a short training run in this process on one gloo rank (a one-rank CPU cluster, fp32 plan,
SGD with momentum: the checkpoint holds the momentum buffers too) gives the median step time
(its summary) and writes a checkpoint at its end. Its state is then written again
(``save_checkpoint``: tensors to safetensors, the rest to JSON, sha256 of it all, temp file
+ fsync + rename) and verified (``load_checkpoint``: parse, sha256 of every tensor; the file
in the page cache, as at a restart), median of ``REPEATS`` each. The cost per step at the
default ``--checkpoint-every`` is (write + verify) / (checkpoint_every x step); a run
verifies only when it resumes, so counting a verify per checkpoint overstates it.

Target: <= 5 % of a step.

Run: ``.venv/bin/python benchmarks/checkpoint.py [--out FILE]``.
"""

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import safetensors
import torch
import torch.distributed as dist

from qsync_lab.cluster import cluster_from_definition
from qsync_lab.graph import trace_graph
from qsync_lab.plan import Plan
from qsync_lab.runtime.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from qsync_lab.runtime.options import TrainConfig
from qsync_lab.runtime.tasks import default_task, load_task
from qsync_lab.runtime.trainer import train
from reporting import finish_report, load_line

TARGET_PCT = 5.0
CHECKPOINT_EVERY = TrainConfig(plan="").checkpoint_every  # the default
REPEATS = 7
#: (zoo model, batch size, training steps)
MODELS = (("digits_cnn", 32, 60), ("resnet18", 16, 8))


def one_rank_plan(model: str, batch: int, path: Path) -> Path:
    """An fp32 plan of ``model`` on a one-rank CPU cluster, saved to ``path``."""
    task = load_task(default_task(model), model)
    torch.manual_seed(0)
    inputs, target = task.example(batch)
    graph = trace_graph(task.build_model(), inputs, target=target, loss_fn=task.loss_fn())
    cluster = cluster_from_definition({"name": "one-cpu", "batch_size": batch, "node": [
        {"name": "localhost", "intra_node_link": "loopback",
         "devices": [{"kind": "cpu", "count": 1}]}]})
    Plan.build(graph, cluster, {}, strategy="fp32").for_model(model).save(path)
    return path


def measure(model: str, batch: int, steps: int, folder: Path) -> dict[str, float]:
    """Train ``steps`` steps (a checkpoint at the end); step, write and verify times (ms)."""
    plan = one_rank_plan(model, batch, folder / f"{model}.json")
    run_dir = folder / model
    summary = train(TrainConfig(str(plan), str(run_dir), steps=steps, checkpoint_every=steps))
    saved = load_checkpoint(checkpoint_path(run_dir, steps))
    manifest = {key: saved.manifest[key] for key in ("step", "settings")}
    write_ms = _median_ms(lambda: save_checkpoint(folder / "again.safetensors", saved.state,
                                                  manifest))
    verify_ms = _median_ms(lambda: load_checkpoint(saved.path))
    return {"file_mib": saved.path.stat().st_size / 2**20,
            "step_ms": summary["measured_step_ms"], "write_ms": write_ms, "verify_ms": verify_ms}


def _median_ms(call) -> float:
    times = []
    for _ in range(REPEATS):
        begin = time.perf_counter()
        call()
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    report = [f"# benchmarks/checkpoint.py, {datetime.datetime.now(datetime.UTC):%Y-%m-%dT%H:%MZ}"
              f", {platform.machine()} CPU ({os.cpu_count()} cores, shared with other jobs), "
              f"torch {torch.__version__}, safetensors {safetensors.__version__}; "
              f"{load_line('before')}",
              f"{'model':>10} {'batch':>5} {'file MiB':>8} {'step ms':>8} {'write ms':>8} "
              f"{'verify ms':>9}  per step at --checkpoint-every {CHECKPOINT_EVERY}"]
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", 1), rank=0,
                                world_size=1)
        try:
            for model, batch, steps in MODELS:
                m = measure(model, batch, steps, Path(folder))
                pct = 100 * (m["write_ms"] + m["verify_ms"]) / (CHECKPOINT_EVERY * m["step_ms"])
                report.append(
                    f"{model:>10} {batch:5d} {m['file_mib']:8.2f} {m['step_ms']:8.2f} "
                    f"{m['write_ms']:8.2f} {m['verify_ms']:9.2f}  {pct:5.2f} % (target <= "
                    f"{TARGET_PCT:g} %: {'ok' if pct <= TARGET_PCT else 'MISS'})")
        finally:
            dist.destroy_process_group()
    finish_report(report, args.out)


if __name__ == "__main__":
    main()
