"""The README's examples are tested code: the facade example runs as printed and stays short,
and the command-line examples write distinct files."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_the_facade_example_is_short_and_runs_as_printed(tmp_path):
    """In a fresh Python, as a user runs it: an earlier in-process training run of this test
    session (a gloo group in pytest's process) left that process's later local runs 2-3x
    slower than predicted."""
    example = _blocks("python")[0]
    assert "qsync_lab.Study(" in example and len(example.strip().splitlines()) <= 15
    # -c, as in a notebook: no script for spawned profilers to re-import
    done = subprocess.run([sys.executable, "-c", example + _REPORT], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    summary = result["summary"]
    assert summary["steps"] == 30 and summary["world_size"] == 2
    assert result["t4_low_precision_ops"] > 0  # the example quantizes something
    # a 30-step run's median, and the profile taken just before it, move with this machine's
    # load (the accuracy itself is measured by benchmarks/predictor_accuracy.py): here only
    # that the prediction is of the run's order - within a factor of 3 - which a step costed
    # in the wrong units is not (a clean-clone CI run predicted 2.1x its measured step: the
    # profile was taken while the other test process trained two gloo ranks)
    assert 1 / 3 < summary["predicted_step_ms"] / summary["measured_step_ms"] < 3
    assert {p.name for p in tmp_path.iterdir()} >= {"iteration.json", "local_plan.json",
                                                     "my_cpu.csv", "run"}


_REPORT = """
import json
with open("result.json", "w") as out:
    json.dump({"summary": summary, "t4_low_precision_ops": plan.low_precision_ops()["T4"]}, out)
"""


def test_the_library_model_example_runs_as_printed_and_plans_low_precision(tmp_path):
    pytest.importorskip("transformers")
    example = next(block for block in _blocks("python") if "transformers" in block)
    report = "\nprint(plan.low_precision_ops()['T4'], plan.cluster.name)"
    done = subprocess.run([sys.executable, "-c", example + report], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    low_ops, cluster = done.stdout.split()[-2:]
    assert int(low_ops) > 0 and cluster == "local-hybrid"


def test_the_command_line_examples_write_distinct_files():
    commands = [line for block in _blocks("bash") for line in block.splitlines()
                if line.startswith("qsync-lab ")]
    outputs = [m.group(1) for line in commands for m in [re.search(r"--out (\S+)", line)] if m]
    assert len(outputs) == len(set(outputs)) >= 3
    plans = {m.group(1) for line in commands for m in [re.search(r"--plan (\S+)", line)] if m}
    assert plans <= set(outputs)  # every plan a command reads is one an example writes
