"""benchmarks/gpu_training.py on the CPU (``--tiny``): every (model, plan) row, sane numbers,
failed rows that do not stop the others, a measured table predicted again, and the card ->
catalog kind mapping."""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_training.py"
MODELS = ["bert_mini", "digits_cnn", "gpt_decoder"]
PLANS = ["fp32", "tf32", "bf16", "fp16", "int8", "fp8_e4m3", "qsync"]
TORCH = ["torch:eager_fp32", "torch:tf32", "torch:autocast_bf16", "torch:autocast_fp16"]


def _benchmark():
    spec = importlib.util.spec_from_file_location("gpu_training", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _script(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out",
                           str(tmp_path), *argv],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def _run(tmp_path: Path, *argv: str) -> pd.DataFrame:
    assert "wrote" in _script(tmp_path, "--tiny", *argv).stdout
    assert (tmp_path / "gpu_training.txt").read_text().startswith("# benchmarks/gpu_training.py")
    return pd.read_csv(tmp_path / "gpu_training.csv")


CPU_PROFILE = str(ROOT / "data/profiles/cpu.csv")


@pytest.fixture(scope="module")
def tiny_table(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    return out, _run(out, "--kernels", "--profile", CPU_PROFILE)


def test_tiny_cpu_run_has_every_row_with_sane_numbers(tiny_table):
    table = tiny_table[1]
    assert sorted(zip(table["model"], table["plan"])) == sorted(
        (m, p) for m in MODELS for p in PLANS + TORCH)
    assert (table["status"] == "ok").all(), table[table["status"] != "ok"]
    assert (table["step_ms"] > 0).all() and (table["mem_mib"] > 0).all()
    assert (table["kernels"] > 0).all() and (table["timed_steps"] == 3).all()
    plans = table[~table["plan"].str.startswith("torch:")]
    for column in ("pred_catalog_ms", "pred_profile_ms", "pred_catalog_mib", "ratio"):
        assert (plans[column] > 0).all() and plans[column].map(math.isfinite).all(), column
    # the error columns are what they say (of the table's rounded figures)
    err = 100 * (plans["pred_catalog_ms"] - plans["step_ms"]) / plans["step_ms"]
    assert plans["err_catalog_pct"].to_numpy() == pytest.approx(err.to_numpy(), abs=0.1)
    assert (plans["mem_err_pct"].abs() < 50).all()  # the memory model, not the clock
    versus = dict(zip(plans["plan"], plans["vs"]))
    assert versus == {"fp32": "torch:eager_fp32", "tf32": "torch:tf32",
                      "bf16": "torch:autocast_bf16", "fp16": "torch:autocast_fp16",
                      "int8": "torch:autocast_bf16", "fp8_e4m3": "torch:autocast_bf16",
                      "qsync": "torch:autocast_bf16"}
    low = plans.set_index(["model", "plan"])["low_precision_ops"]
    assert all(low[(m, "fp32")] == 0 and low[(m, "bf16")] > 0 and low[(m, "int8")] > 0
               for m in MODELS)
    assert table[table["plan"].str.startswith("torch:")]["pred_catalog_ms"].isna().all()


def test_a_measured_table_predicted_again_by_the_same_code_gives_its_predictions(tiny_table):
    out, table = tiny_table
    _script(out, "--kind", "cpu", "--profile", CPU_PROFILE,
            "--repredict", str(out / "gpu_training.csv"))
    again = pd.read_csv(out / "gpu_training_repredicted.csv")
    assert (out / "gpu_training_repredicted.txt").read_text().startswith(
        f"# {out / 'gpu_training.csv'} predicted again")
    assert list(again["plan"]) == list(table["plan"])
    columns = ["step_ms", "pred_catalog_ms", "pred_profile_ms", "pred_catalog_mib",
               "low_precision_ops"]
    assert again[columns].equals(table[columns])  # measured figures kept, predictions alike
    errors = again["err_profile_pct"].dropna()  # of unrounded predictions: 0.01 apart
    assert errors.to_numpy() == pytest.approx(table["err_profile_pct"].dropna(), abs=0.01)
    plans = again[~again["plan"].str.startswith("torch:")]
    assert (plans["low_precision_ops_now"] == plans["low_precision_ops"]).all()
    assert again[again["plan"].str.startswith("torch:")]["pred_profile_ms"].isna().all()


def test_a_profile_named_for_one_model_predicts_only_its_rows(tiny_table):
    out, _ = tiny_table
    args = _benchmark().parse_args(["--profile", "digits_cnn=a.csv", "--profile", "/x=y.csv"])
    assert args.profile == {"digits_cnn": "a.csv", None: "/x=y.csv"}
    _script(out, "--kind", "cpu", "--profile", f"digits_cnn={CPU_PROFILE}",
            "--repredict", str(out / "gpu_training.csv"))
    again = pd.read_csv(out / "gpu_training_repredicted.csv")
    plans = again[~again["plan"].str.startswith("torch:")]
    named = plans["model"] == "digits_cnn"
    assert (plans.loc[named, "pred_profile_ms"] > 0).all()
    assert plans.loc[~named, "pred_profile_ms"].isna().all() and (~named).any()


def test_a_failing_plan_is_a_failed_row_and_the_others_run(tmp_path):
    # a T4 has no bf16: that plan is refused when it is built; fp32 and torch still run
    table = _run(tmp_path, "--kind", "T4", "--models", "digits_cnn", "--plans", "bf16,fp32",
                 "--torch-runs", "eager_fp32")
    status = dict(zip(table["plan"], table["status"]))
    assert list(table["plan"]) == ["torch:eager_fp32", "fp32", "bf16"]
    assert status["bf16"].startswith("failed: ") and "bf16" in status["bf16"]
    assert "\n" not in status["bf16"]
    assert status["fp32"] == status["torch:eager_fp32"] == "ok"


@pytest.mark.parametrize(("card", "memory_gib", "kind"), [
    ("NVIDIA H200", 140.4, "H200-SXM-141GB"),
    ("NVIDIA H100 80GB HBM3", 79.6, "H100-SXM5-80GB"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "A100-SXM4-80GB"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "A100-SXM4-40GB"),
    ("NVIDIA GeForce RTX 4090", 23.6, "RTX-4090"),
    ("Tesla T4", 14.6, "T4"),
])
def test_card_names_map_to_their_catalog_kind(card, memory_gib, kind):
    assert _benchmark().catalog_kind(card, int(memory_gib * 2**30)).name == kind
