"""benchmarks/hybrid_gpu.py without a GPU: the one-GPU hybrid's cluster file, its plans and
their predictions (``--dry-run``), the rows of a measured run (ok, failed, stopped, skipped
past the budget; a stand-in study) and the one-line refusal to measure on a machine without
a GPU."""

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from qsync_lab.cluster import load_cluster
from qsync_lab.errors import QSyncError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "hybrid_gpu.py"


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_dry_run_plans_every_strategy_for_a_fast_and_a_slow_partition(tmp_path):
    done = _run("--dry-run", "--kind", "H100-SXM5-80GB", "--models", "bert_mini",
                "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    cluster = load_cluster(tmp_path / "hybrid_cluster.toml")
    assert [(r.sms, r.gpu_index) for r in cluster.ranks] == [(116, 0), (16, 0)]
    table = pd.read_csv(tmp_path / "hybrid_gpu.csv").set_index("strategy")
    assert list(table.index) == ["fp32", "qsync", "uniform-low", "dynamic-batching"]
    assert (table["status"] == "planned").all()
    # the slow partition holds the fast one back at fp32; qsync quantizes some of its ops,
    # fewer than uniform low precision, and is predicted faster than fp32
    assert table.at["fp32", "pred_idle_fast_ms"] > table.at["fp32", "pred_idle_slow_ms"]
    assert 0 < table.at["qsync", "slow_low_precision_ops"] < \
        table.at["uniform-low", "slow_low_precision_ops"]
    assert table.at["qsync", "pred_step_ms"] < table.at["fp32", "pred_step_ms"]
    assert (tmp_path / "hybrid_bert_mini_qsync.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_measuring_without_a_gpu_is_refused_in_one_line(tmp_path):
    done = _run("--models", "bert_mini", "--out", str(tmp_path))
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert "no CUDA GPU here" in done.stderr


def _benchmark():
    spec = importlib.util.spec_from_file_location("hybrid_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Study:
    """Runs a plan named ``ok`` (a summary and one step of metrics), fails ``bad`` in one
    line and is stopped (as SIGALRM stops it) on ``slow``."""

    def __init__(self, stopped):
        self.stopped = stopped
        self.runs = []

    def run(self, plan, *, steps, run_dir, seed, checkpoint_every):
        self.runs.append((plan.name, checkpoint_every))
        if plan.name == "bad":
            raise QSyncError("the run failed (torchrun exit 1): CUDA out of memory")
        if plan.name == "slow":
            raise self.stopped("SIGALRM")
        Path(run_dir).mkdir(parents=True)
        (Path(run_dir) / "metrics.jsonl").write_text('{"step": 0, "loss": 2.5}\n')
        return {"measured_step_ms": 400.0}


class _Plan:
    def __init__(self, name):
        self.name = name
        self.cluster = type("Cluster", (), {"global_batch_size": 64})()


def test_measured_rows_keep_going_past_a_failure_and_stop_at_the_budget(tmp_path):
    bench = _benchmark()
    study = _Study(bench.Stopped)
    planned = [((study, _Plan(name)), {"model": "m", "strategy": name, "seed": 0,
                                       "pred_step_ms": 300.0})
               for name in ("ok", "bad", "slow", "never")]
    planned.insert(1, ((study, None), {"model": "m", "strategy": "unplanned", "seed": 0,
                                      "status": "failed: no plan"}))
    args = type("Args", (), {"out": tmp_path, "steps": 3, "budget_s": 100.0})()
    rows = []
    bench.measure_rows(args, planned, rows, "# header", time.monotonic() + 100,
                       {"sharing": "mps (started)", "granted_sms": "116+16"})
    status = {r["strategy"]: r["status"] for r in rows}
    assert status == {"ok": "ok", "unplanned": "failed: no plan",
                      "bad": "failed: qsync_lab.errors.QSyncError: the run failed (torchrun "
                             "exit 1): CUDA out of memory",
                      "slow": "stopped: SIGALRM", "never": "skipped: stopped (SIGALRM)"}
    assert study.runs == [("ok", 0), ("bad", 0), ("slow", 0)]  # no checkpoints mid-run
    table = pd.read_csv(tmp_path / "hybrid_gpu.csv").set_index("strategy")
    assert table.at["ok", "step_ms"] == 400 and table.at["ok", "err_pct"] == -25
    assert table.at["ok", "samples_per_s"] == 160 and table.at["ok", "final_loss"] == 2.5
    assert (table["sharing"] == "mps (started)").all()
    assert (tmp_path / "hybrid_gpu.txt").read_text().startswith("# header\n")
    # a budget that a row would overrun: the rows left are skipped, none is started
    rows, study.runs = [], []
    bench.measure_rows(args, planned[:1], rows, "# header", time.monotonic() + 10, {})
    assert rows[0]["status"] == "skipped: --budget-s 100 spent" and not study.runs


def test_partitions_that_fail_under_mps_run_time_sliced_or_not_at_all(monkeypatch):
    from qsync_lab.runtime import gpu_share

    bench = _benchmark()
    stopped = []

    @contextlib.contextmanager
    def daemon(shared):
        try:
            yield "started"
        finally:
            stopped.append(shared)

    monkeypatch.setattr(gpu_share, "mps_daemon", daemon)
    monkeypatch.setenv(gpu_share.MPS_ENV, "on")  # restored after the test
    answers = iter([(None, "RuntimeError: CUDA error: MPS client failed"), ("116+16", None),
                    (None, "RuntimeError: CUDA error"), (None, "QSyncError: no green contexts")])
    monkeypatch.setattr(bench, "probe", lambda shares: next(answers))
    with contextlib.ExitStack() as mps:
        assert bench.share_gpu(mps, [116, 16]) == ("time-sliced (no MPS)", "116+16")
        assert stopped == [[0]]  # MPS stopped before the ranks run without it
    assert os.environ[gpu_share.MPS_ENV] == "off"
    monkeypatch.setenv(gpu_share.MPS_ENV, "on")
    with pytest.raises(QSyncError, match="fail without MPS too: QSyncError: no green"):
        with contextlib.ExitStack() as mps:
            bench.share_gpu(mps, [116, 16])
