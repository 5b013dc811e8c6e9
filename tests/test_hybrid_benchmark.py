"""benchmarks/hybrid_gpu.py without a GPU: the one-GPU hybrid's cluster file, its plans and
their predictions (``--dry-run``), and the one-line refusal to measure on a machine without
a GPU."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from qsync_lab.cluster import load_cluster

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
    assert list(table.index) == ["fp32", "uniform-low", "dynamic-batching", "qsync"]
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
