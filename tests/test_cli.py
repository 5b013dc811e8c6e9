import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
import torch

from qsync_lab.cli import main
from qsync_lab.cli.lab import LAB_NOTEBOOK, lab_environment, voila_command
from qsync_lab.resources import data_file

TINY_NOTEBOOK = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": {
    "name": "python3", "display_name": "Python 3", "language": "python"}}, "cells": [{
        "cell_type": "code", "id": "c0", "metadata": {}, "execution_count": None,
        "outputs": [], "source": "print('tiny lab ' + 'ok')"}]}
LAB_TIMEOUT_S = 60


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_graph_prints_the_operator_table_and_writes_csv(capsys, tmp_path):
    csv = tmp_path / "ops.csv"
    code, out, _ = run(capsys, "graph", "--model", "digits_cnn", "--batch", "4", "--rows", "3",
                       "--csv", str(csv))
    assert code == 0
    assert "digits_cnn: 12 operators, 38,378 parameters, traced with fx" in out
    assert "conv1" in out and "... 9 more operators" in out
    table = pd.read_csv(csv, index_col="name")
    assert len(table) == 12 and table.loc["conv1", "kind"] == "conv2d"
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temp file


def test_cluster_prints_summary(capsys):
    code, out, _ = run(capsys, "cluster", "qsync-paper")
    assert code == 0
    assert "qsync-paper: 32 ranks on 4 nodes" in out
    assert "16 x T4" in out and "V100-SXM2-32GB" in out


def test_models_and_clusters_list_everything(capsys):
    _, models, _ = run(capsys, "models")
    _, clusters, _ = run(capsys, "clusters")
    assert {"resnet50", "bert_base", "digits_cnn"} <= {line.split()[0] for line in
                                                        models.splitlines()}
    assert "local-hybrid" in clusters and "qsync-paper" in clusters


@pytest.mark.parametrize("argv,message", [
    (["graph", "--model", "resnet5"], "unknown model 'resnet5'"),
    (["graph", "--model", "digits_mlp", "--batch", "0"],
     "--batch must be an integer from 1 to 1048576, got 0"),
    (["simulate", "--model", "digits_cnn", "--batch", "100000000"],  # was an allocator error
     "--batch must be an integer from 1 to 1048576, got 100000000"),
    (["cluster", "no-such-cluster"], "unknown cluster 'no-such-cluster'"),
])
def test_bad_input_is_one_line_on_stderr_with_exit_code_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("qsync-lab: error: ") and message in err
    assert err.count("\n") == 1


def test_a_baseline_plan_says_which_constraints_it_misses(capsys, tmp_path):
    """The baselines plan without the constraints (which the plan records): what they miss
    is said, not left for the run to find."""
    profile = str(data_file("profiles", "cpu.csv"))
    code, out, _ = run(capsys, "plan", "--model", "digits_mlp", "--cluster", "local-hybrid",
                       "--profile", profile, "--strategy", "fp32", "--memory-gb", "T4=1e-7",
                       "--throughput", "1e12", "--out", str(tmp_path / "p.json"))
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert code == 0 and len(notes) == 2, out
    assert notes[0].startswith("note: the fp32 plan does not meet T4's memory budget of 1e-07 "
                               "GiB (its ranks' tensors peak at ")
    assert re.fullmatch(r"note: the fp32 plan does not meet the throughput target of 1e\+12 "
                        r"samples/s \(it reaches \d+\)", notes[1])
    code, out, _ = run(capsys, "plan", "--model", "digits_mlp", "--cluster", "local-hybrid",
                       "--profile", profile, "--strategy", "fp32", "--out",
                       str(tmp_path / "p.json"))
    assert code == 0 and "note:" not in out  # device memory and the fp32 pace: met


def test_profiling_more_processes_than_the_cores_carry_is_one_line(capsys, tmp_path):
    """1000 processes on this machine started profiling (and never finished)."""
    code, out, err = run(capsys, "profile", "--model", "digits_mlp", "--processes", "1000",
                         "--out", str(tmp_path / "p.csv"))
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith(f"qsync-lab: error: 1000 processes x 1 threads on this machine's "
                          f"{os.cpu_count()} cores (at most {2 * os.cpu_count()}) would time "
                          "contention, not ops")
    assert not (tmp_path / "p.csv").exists()


def test_console_script_entry_point_runs_the_demo(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-m", "qsync_lab", "demo", "--model", "bert_mini",
                             "--steps", "6", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout
    assert "123 operators" in text and "DDP gradient buckets" in text
    assert "qsync-paper: 32 ranks" in text and "most sensitive ops at int8" in text
    assert {"fp32", "uniform-low", "dynamic-batching", "qsync", "joint"} <= set(
        line.split()[0] for line in text.splitlines() if line.strip())
    assert all(f"== {n}." in text for n in range(1, 10))
    from qsync_lab.plan import Plan

    assert Plan.load(out / "paper_plan.json").cluster_name == "qsync-paper"
    assert f"the report {out / 'paper_report.html'}" in text
    assert (out / "paper_report.html").read_text().count('class="plotly-graph-div"') == 5
    paper_trace = json.loads((out / "paper_trace.json").read_text())
    assert len({e["pid"] for e in paper_trace["traceEvents"] if e["ph"] == "X"}) == 32
    plan = Plan.load(out / "plan.json")
    assert (plan.cluster_name, plan.model_name) == ("local-hybrid", "bert_mini")
    trace = json.loads((out / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["world_size"] == 2
    assert f"measured {summary['measured_step_ms']:.2f} ms" in text
    assert f"predicted {summary['predicted_step_ms']:.2f} ms" in text


def test_run_launches_torchrun_on_a_plan(tmp_path, capsys):
    from tests.runtime.conftest import write_plan

    plan = write_plan(tmp_path / "plan.json", "local-cpu", {}, model="digits_mlp",
                      task="synthetic")
    argv = ["run", "--plan", str(plan), "--steps", "3", "--data", "synthetic", "--run-dir",
            str(tmp_path / "run"), "--threads", "1", "--checkpoint-every", "3"]
    code, out, _ = run(capsys, *argv)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert code == 0 and summary["steps"] == 3
    # quiet: one line of results; torchrun's banner and the ranks' output are in the log
    assert out.count("\n") == 1 and "torch.distributed" not in out
    assert f"step time measured {summary['measured_step_ms']:.2f} ms" in out
    log = (tmp_path / "run" / "launch.log").read_text()
    assert "OMP_NUM_THREADS" in log and "test loss" in log  # synthetic: no accuracy shown
    # fewer steps than the default warm-up: at least one step is timed, and the summary says so
    assert (summary["warmup_steps"], summary["timed_steps"]) == (2, 1)
    # resumed once complete (its summary lost): a note on the terminal, nothing else, and
    # no process started (the launcher checks the checkpoint: launch.log is the run's)
    (tmp_path / "run" / "summary.json").unlink()
    code, out, err = run(capsys, *argv, "--resume")
    assert (code, out, (tmp_path / "run" / "launch.log").read_text()) == (0, "", log)
    assert err.splitlines() == [
        "qsync_lab: run already complete at step 3; nothing to do (its summary.json is missing: "
        "the run stopped before writing it; metrics.jsonl has its steps)"]


def test_run_emulates_a_gpu_plan_on_the_cpu_and_says_so(tmp_path, capsys):
    """--emulate: a V100 + T4 plan trains on this CPU, predicted for this CPU emulating
    them; the synthetic task's accuracy is not printed as a result (its labels are
    random), and the summary line says what the plan was made under."""
    from tests.runtime.conftest import cluster_file, write_plan

    cluster = cluster_file(tmp_path, ['{ kind = "V100-SXM2-32GB", count = 1 }',
                                      '{ kind = "T4", count = 1 }'], name="v100-t4")
    plan = write_plan(tmp_path / "plan.json", cluster, {}, model="digits_mlp", task="synthetic")
    code, out, _ = run(capsys, "run", "--plan", str(plan), "--steps", "4", "--data",
                       "synthetic", "--run-dir", str(tmp_path / "run"), "--threads", "1",
                       "--checkpoint-every", "0", "--emulate")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert code == 0 and summary["emulating"] == ["V100-SXM2-32GB", "T4"]
    assert (f"predicted for this CPU emulating V100-SXM2-32GB/T4 "
            f"{summary['predicted_step_ms']:.2f} ms") in out
    assert "(no accuracy: the synthetic task has random labels, it times runs)" in out
    assert "test accuracy" not in out
    assert f"; plan: {summary['plan_made_under']}; wrote" in out
    assert "constraints not recorded" in summary["plan_made_under"]  # write_plan records none


def test_run_without_a_readable_plan_is_one_line(capsys):
    code, _, err = run(capsys, "run", "--plan", "missing.json")
    assert code == 2 and "cannot read plan missing.json" in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory):
    from tests.runtime.conftest import write_plan

    folder = tmp_path_factory.mktemp("plan")
    return write_plan(folder / "plan.json", "local-cpu", {}, model="digits_mlp",
                      task="synthetic")


@pytest.mark.parametrize("extra, message", [
    (["--steps", "-1"], "--steps must be a positive integer, got -1"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--optimizer", "lion"], "argument --optimizer: invalid choice: 'lion'"),
    (["--lr", "nan"], "--lr must be a finite non-negative number"),
    (["--model-kwargs", "{oops"], "cannot read --model-kwargs: invalid JSON"),
    (["--model-kwargs", "[" * 5000 + "]" * 5000], "--model-kwargs: nested deeper than 32"),
    (["--model", "digits_cnn"], "the plan was made for another model"),
    (["--model", "resnet5"], "unknown model 'resnet5'"),
    (["--data", "imagenet"], "unknown --data 'imagenet'"),
    (["--nproc-per-node", "3"], "the plan is for 2 ranks"),
    (["--allow-change", "steps,seed"], "a change of 'seed' makes another run"),
    (["--allow-change", "steps"], "--allow-change applies with --resume"),
    (["--profile", "no-such.csv"], "cannot read profile no-such.csv"),
    (["--data", "tokens"], "task 'tokens' trains bert_mini, not digits_mlp; use --data"),
    (["--seed", "-1"], "--seed must be an integer from 0 to 2**32 - 1, got -1"),
    (["--momentum", "2"], "--momentum must be below 1 (0.9 is usual), got 2.0"),
    (["--threads", "1000"], "--threads 1000 per rank: this machine has"),
    (["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "host:99999"],
     "--rdzv-endpoint 'host:99999' is not HOST:PORT with a port from 1 to 65535"),
])
def test_run_refuses_bad_input_before_starting_any_process(mlp_plan, tmp_path, extra, message):
    """One line on stderr, exit 2, in a fresh process, before torchrun starts (no log)."""
    run_dir = tmp_path / "run"
    begin = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "qsync_lab", "run", "--plan", str(mlp_plan),
                           "--run-dir", str(run_dir), *extra], capture_output=True, text=True,
                          timeout=60)
    seconds = time.perf_counter() - begin
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("qsync-lab: error: ") and message in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert not run_dir.exists()
    if extra[0] in ("--steps", "--optimizer", "--lr", "--model-kwargs", "--nproc-per-node",
                    "--allow-change", "--seed", "--momentum"):
        assert seconds < 2.0, seconds  # checked before torch is imported


@pytest.mark.parametrize("argv,message", [
    ("plan --model digits_mlp --cluster local-cpu --profile {csv} --out {csv}",
     "--out {csv} is also an input of this command: writing would replace it; choose another "
     "--out"),
    ("simulate --plan {plan} --trace {plan}", "--trace {plan} is also an input of this "
     "command: writing would replace it; choose another --trace"),
    ("simulate --plan {plan} --trace {fifo}", "--trace {fifo} is not a regular file (a pipe "
     "or a device); name a file to write"),
    ("graph --model digits_mlp --csv {tmp}", "--csv {tmp} is a folder; name a file to write"),
    ("profile --model digits_mlp --out {plan}/p.csv", "--out {plan}/p.csv: {plan} is a file, "
     "not a folder; choose another --out"),
    ("demo --out {plan}", "--out {plan}: {plan} is a file, not a folder; choose another --out"),
], ids=["plan-over-its-profile", "trace-over-its-plan", "trace-over-a-fifo", "csv-a-folder",
        "profile-under-a-file", "demo-into-a-file"])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(
        mlp_plan, tmp_path, capsys, argv, message):
    """In one line, and nothing is replaced: neither the command's own input nor a pipe."""
    csv, fifo = tmp_path / "mine.csv", tmp_path / "fifo"
    csv.write_bytes(data_file("profiles", "cpu.csv").read_bytes())
    os.mkfifo(fifo)
    names = {"csv": csv, "plan": mlp_plan, "fifo": fifo, "tmp": tmp_path}
    before = {path: path.read_bytes() for path in (csv, mlp_plan)}
    code, out, err = run(capsys, *argv.format(**names).split())
    assert (code, out, err) == (2, "", f"qsync-lab: error: {message.format(**names)}\n")
    assert {path: path.read_bytes() for path in before} == before and fifo.is_fifo()


@pytest.mark.parametrize("run_dir", ["afile", "afile/run"])
def test_a_run_dir_that_cannot_be_a_folder_is_one_line(mlp_plan, tmp_path, capsys, run_dir):
    (tmp_path / "afile").write_text("")
    assert main(["run", "--plan", str(mlp_plan), "--run-dir", str(tmp_path / run_dir)]) == 2
    assert capsys.readouterr().err == (f"qsync-lab: error: --run-dir {tmp_path / run_dir}: "
                                       f"{tmp_path / 'afile'} is a file, not a folder; choose "
                                       "another --run-dir\n")


def test_ctrl_c_in_a_run_is_one_line_saying_how_to_continue(mlp_plan, tmp_path, monkeypatch,
                                                            capsys):
    """launch stops the ranks on Ctrl-C and lets the KeyboardInterrupt through (see
    tests/runtime/test_launch.py); the CLI ends in one line, exit 130."""
    from qsync_lab.runtime import launch

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "launch", interrupted)
    assert main(["run", "--plan", str(mlp_plan), "--run-dir", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err.strip() == (
        "qsync-lab: interrupted; the ranks were stopped: the same command with --resume "
        "continues from the last checkpoint")


def test_a_broken_pipe_ends_quietly():
    done = subprocess.run(f"{sys.executable} -m qsync_lab graph --model resnet50 --rows 0 | "
                          "head -n 1", shell=True, capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("resnet50: ") and done.stderr == ""


def test_simulate_takes_the_file_plan_writes(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert run(capsys, "plan", "--model", "resnet18", "--cluster", "local-hybrid",
               "--calibration-batches", "1", "--out", str(out))[0] == 0
    code, text, err = run(capsys, "simulate", "--plan", str(out), "--trace",
                          str(tmp_path / "t.json"))
    assert code == 0, err
    assert text.startswith("resnet18 on local-hybrid (2 ranks")
    code, _, err = run(capsys, "simulate", "--plan", str(out), "--uniform", "T4=fp16")
    assert code == 2 and "--uniform applies without --plan" in err


def test_runtime_options_are_only_for_run(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["graph", "--model", "digits_mlp", "--steps", "3"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --steps 3" in capsys.readouterr().err


def test_simulate_prints_the_iteration_and_writes_a_trace(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    code, out, _ = run(capsys, "simulate", "--model", "digits_mlp", "--cluster", "v100-t4-small",
                       "--uniform", "T4=fp16", "--trace", str(trace))
    assert code == 0
    assert "digits_mlp on v100-t4-small (4 ranks" in out and "samples/s" in out
    import json

    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1, 2, 3}
    assert any(e.get("args", {}).get("precision") == "fp16" for e in events if e["ph"] == "X")


@pytest.mark.parametrize("argv,message", [
    (["--uniform", "T4"], "--uniform expects DEVICE=PRECISION"),
    (["--plan", "missing.json"], "cannot read plan missing.json"),
])
def test_simulate_bad_plan_input(capsys, argv, message):
    code, _, err = run(capsys, "simulate", "--model", "digits_mlp", *argv)
    assert code == 2 and message in err and err.count("\n") == 1


def test_plan_writes_a_plan_that_loads_back(capsys, tmp_path):
    from qsync_lab.plan import Plan

    out = tmp_path / "plan.json"
    code, text, _ = run(capsys, "plan", "--model", "digits_mlp", "--cluster", "v100-t4-small",
                        "--calibration-batches", "1", "--out", str(out))
    assert code == 0 and f"wrote {out}" in text
    plan = Plan.load(out)
    assert (plan.cluster_name, plan.model_name) == ("v100-t4-small", "digits_mlp")
    assert len(plan.ranks) == 4


def test_plan_records_the_constraints_it_was_made_under(capsys, tmp_path):
    from qsync_lab.plan import Plan

    out = tmp_path / "plan.json"
    code, _, _ = run(capsys, "plan", "--model", "digits_mlp", "--cluster", "v100-t4-small",
                     "--calibration-batches", "1", "--memory-gb", "t4=4", "--throughput", "5",
                     "--strategy", "uniform-low", "--out", str(out))
    plan = Plan.load(out)
    assert code == 0 and plan.strategy == "uniform-low"
    assert (dict(plan.constraints.memory_gib), plan.constraints.throughput_samples_per_s) == (
        {"T4": 4.0}, 5.0)


def test_plan_and_simulate_with_compression(capsys, tmp_path):
    from qsync_lab.plan import Plan

    out = tmp_path / "plan.json"
    code, text, _ = run(capsys, "plan", "--model", "digits_cnn", "--cluster", "v100-t4-small",
                        "--calibration-batches", "1", "--compress", "cgx:4,error_feedback=true",
                        "--out", str(out))
    assert code == 0 and "compression cgx:4,error_feedback=true" in text
    settings = Plan.load(out).compression_settings
    assert settings.spec_for("conv2.weight", numel=18432, ndim=4).error_feedback
    code, text, _ = run(capsys, "simulate", "--plan", str(out))
    compressed_ms = float(text.split("iteration ")[1].split(" ms")[0])
    code, text, _ = run(capsys, "simulate", "--plan", str(out), "--compress", "fp16")
    assert code == 0 and float(text.split("iteration ")[1].split(" ms")[0]) != compressed_ms


@pytest.mark.parametrize("command", ["plan", "simulate", "profile"])
def test_a_bad_compression_spec_fails_in_one_line_before_any_work(capsys, command):
    out = [] if command == "simulate" else ["--out", "x.json"]
    code, _, err = run(capsys, command, "--model", "digits_mlp", "--compress", "cgx:12", *out)
    assert code == 2 and "compression cgx: bits must be 1..8, got 12" in err
    assert err.count("\n") == 1


def test_plan_bad_memory_budget_is_one_line(capsys):
    code, _, err = run(capsys, "plan", "--model", "digits_mlp", "--memory-gb", "T4=lots",
                       "--out", "x.json")
    assert code == 2 and "--memory-gb expects KIND=GIB" in err


def test_profile_writes_a_table_the_cost_model_reads(capsys, tmp_path):
    from qsync_lab.costs import load_cost_model, read_link_fits, read_profile

    out = tmp_path / "cpu.csv"
    code, text, _ = run(capsys, "profile", "--model", "digits_mlp", "--batch", "4",
                        "--precisions", "fp32,bf16", "--repeats", "2", "--processes", "2",
                        "--links", "allreduce", "--out", str(out))  # DDP's: test_ddp_link
    assert code == 0 and f"wrote {out}" in text
    assert "loopback" in read_link_fits(out)
    rows = read_profile(out).frame
    assert set(rows.loc[rows["op"] == "fc1", "precision"]) == {"fp32", "bf16"}
    ops = rows[rows["phase"] != "cast"]
    # a tiny op's backward may cost no more than the autograd call subtracted from it (0)
    assert (ops["time_us"] >= 0).all()
    assert (ops.loc[ops["phase"] == "forward", "time_us"] > 0).all()
    assert load_cost_model(out).profiles[0].source == "profile:cpu.csv"


def test_profile_times_the_compressors_the_cost_model_then_uses(capsys, tmp_path):
    from qsync_lab.costs import load_cost_model, read_profile

    out = tmp_path / "cpu.csv"
    code, text, _ = run(capsys, "profile", "--model", "digits_mlp", "--batch", "4",
                        "--precisions", "fp32", "--repeats", "2", "--links", "allreduce",
                        "--compress", "fp16", "cgx:4,error_feedback=true", "--out", str(out))
    assert code == 0
    rows = read_profile(out).frame
    compress = rows[rows["phase"] == "compress"]
    assert set(compress["op"]) == {"fp16", "cgx:4,error_feedback=true"}
    assert set(compress["kind"]) == {"encode", "decode"} and (compress["time_us"] > 0).all()
    fits = load_cost_model(out).compress_fits
    assert {(spec, step) for _, spec, step in fits} == {
        (s, k) for s in ("fp16", "cgx:4,error_feedback=true") for k in ("encode", "decode")}
    # the error feedback's passes cost more than fp16's cast, at 16 M elements
    assert (fits["cpu", "cgx:4,error_feedback=true", "encode"].time_us(2**24)
            > fits["cpu", "fp16", "encode"].time_us(2**24))


def test_profile_rejects_bad_numbers(capsys):
    code, _, err = run(capsys, "profile", "--model", "digits_mlp", "--threads", "0",
                       "--out", "x.csv")
    assert code == 2 and "must be positive integers" in err


def test_lab_builds_a_local_voila_command_without_the_token():
    command = voila_command(Path("tuner.ipynb"), port=8123)
    assert command[:4] == [sys.executable, "-m", "voila", "tuner.ipynb"]
    assert {"--no-browser", "--Voila.ip=127.0.0.1", "--Voila.port=8123",
            "--Voila.port_retries=0", "--Voila.auto_token=True",
            "--MappingKernelManager.cull_idle_timeout=60",
            "--MappingKernelManager.cull_interval=15", "--template=qsync"} == set(command[4:])
    shorter = voila_command(Path("tuner.ipynb"), port=8123, idle_s=6)
    assert {"--MappingKernelManager.cull_idle_timeout=6",
            "--MappingKernelManager.cull_interval=1"} <= set(shorter)


def test_the_lab_app_is_the_tuner_panel_alone():
    """The app notebook builds one tuner from the lab's environment and shows its panel:
    no tutorial cell changes it, and it is saved without outputs."""
    notebook = json.loads(LAB_NOTEBOOK.read_text())
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert len(code) == 1 and not code[0]["outputs"]
    source = "".join(code[0]["source"])
    assert source.rstrip().endswith("shown.update(tuner.panel)")  # after a line at once
    read = [name for name in lab_environment("m", "c", ".") if name.startswith("QSYNC_LAB_")]
    assert len(read) == 3 and all(f'"{name}"' in source for name in read), source


def test_the_lab_exports_where_it_was_started(tmp_path):
    env = lab_environment("digits_cnn", "local-hybrid", tmp_path / ".")
    assert {k: env[k] for k in ("QSYNC_LAB_MODEL", "QSYNC_LAB_CLUSTER", "QSYNC_LAB_ROOT")} == {
        "QSYNC_LAB_MODEL": "digits_cnn", "QSYNC_LAB_CLUSTER": "local-hybrid",
        "QSYNC_LAB_ROOT": str(tmp_path.resolve())}
    # Voila finds the lab's page template on JUPYTER_PATH
    template = env["JUPYTER_PATH"].split(os.pathsep)[0]
    assert (Path(template) / "voila" / "templates" / "qsync" / "index.html.j2").is_file()


def test_lab_without_its_notebook_is_one_line(capsys, tmp_path):
    code, out, err = run(capsys, "lab", "--notebook", str(tmp_path / "none.ipynb"))
    assert code == 2 and out == ""
    assert err == f"qsync-lab: error: notebook {tmp_path / 'none.ipynb'} not found; pass " \
        "--notebook PATH\n"


@pytest.mark.parametrize("argv,message", [
    (["--model", "nosuch"], "unknown model 'nosuch'"),
    (["--cluster", "nosuch"], "unknown cluster 'nosuch'"),
    (["--notebook", str(LAB_NOTEBOOK.parent / "devices.toml")], "is not a notebook (.ipynb)"),
])
def test_lab_refuses_what_its_page_would_fail_on_before_serving(capsys, monkeypatch, argv,
                                                                message):
    """The page showed the error as a traceback once served."""
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("Voila was started"))
    code, out, err = run(capsys, "lab", *argv)
    assert (code, out) == (2, "") and message in err and err.count("\n") == 1


def test_lab_with_a_negative_idle_time_is_one_line(capsys):
    code, out, err = run(capsys, "lab", "--idle-s", "-1")
    assert code == 2 and out == ""
    assert err == "qsync-lab: error: --idle-s must be 0 (never stop) or more seconds, got -1\n"


def test_lab_without_voila_says_what_to_install(capsys, tmp_path, monkeypatch):
    notebook = tmp_path / "tiny.ipynb"
    notebook.write_text(json.dumps(TINY_NOTEBOOK))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "voila" else find_spec(name, *a))
    code, _, err = run(capsys, "lab", "--notebook", str(notebook))
    assert code == 2 and "pip install -e '.[notebook]'" in err and err.count("\n") == 1


@pytest.mark.skipif(importlib.util.find_spec("voila") is None,
                    reason="voila is not installed (pip install -e '.[notebook]')")
def test_lab_serves_the_notebook_behind_its_token(tmp_path):
    notebook = tmp_path / "tiny.ipynb"
    notebook.write_text(json.dumps(TINY_NOTEBOOK))
    stdout, stderr = tmp_path / "lab.out", tmp_path / "lab.err"
    with stdout.open("w") as out, stderr.open("w") as err:
        lab = subprocess.Popen([sys.executable, "-m", "qsync_lab", "lab", "--port",
                                str(_free_port()), "--notebook", str(notebook)],
                               stdout=out, stderr=err, start_new_session=True)
    try:
        url, page = _served_page(lab, stdout, stderr)
        assert "tiny lab ok" in page  # the notebook ran
        assert _get(url.split("?")[0])[0] != 200  # no token, no notebook
        kernels = _descendants(lab.pid)
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(timeout=30)
    assert _all_exited(kernels), f"left running: {kernels}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _served_page(lab: subprocess.Popen, stdout: Path, stderr: Path) -> tuple[str, str]:
    """The URL ``qsync-lab lab`` printed and its page, once the server answers it (200)."""
    deadline = time.monotonic() + LAB_TIMEOUT_S
    while time.monotonic() < deadline:
        assert lab.poll() is None, stderr.read_text()[-2000:]
        found = re.search(r"http://127\.0\.0\.1:\d+/\?token=\S+", stdout.read_text())
        try:
            status, page = _get(found.group(0)) if found else (None, "")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            status = None  # not listening yet
        if status == 200:
            return found.group(0), page
        time.sleep(0.5)
    raise AssertionError(f"no answer in {LAB_TIMEOUT_S} s: {stderr.read_text()[-2000:]}")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def _get(url: str) -> tuple[int, str]:
    """Status and body of a GET that follows no redirect (a login page is not the app)."""
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(url, timeout=LAB_TIMEOUT_S) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (the kernel runs in a session of its own)."""
    children = [int(c) for task in Path(f"/proc/{pid}/task").glob("*")
                for c in (task / "children").read_text().split()]
    return children + [d for c in children for d in _descendants(c)]


def _all_exited(pids: list[int], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(map(_running, pids))


def _running(pid: int) -> bool:
    """Whether ``pid`` is alive (a zombie waiting for its reaper is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_profile_on_a_gpu_without_one_is_one_line(capsys, tmp_path):
    code, _, err = run(capsys, "profile", "--model", "digits_cnn", "--device", "cuda",
                       "--out", str(tmp_path / "gpu.csv"))
    assert code == 2 and "no CUDA GPU is visible" in err and err.count("\n") == 1
    assert not (tmp_path / "gpu.csv").exists()
