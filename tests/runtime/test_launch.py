"""``qsync-lab run``'s launcher: Ctrl-C stops every rank; the ranks' notes and their
exception reach the terminal; what this machine cannot run is refused before any process
starts, each refusal naming the way out."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from qsync_lab.cli import main
from qsync_lab.errors import QSyncError
from qsync_lab.runtime import launch, machine
from qsync_lab.runtime.metrics import summary_line
from qsync_lab.runtime.options import TrainConfig, runtime_argv

from qsync_lab.plan import Plan
from qsync_lab.runtime.checkpoint import checkpoint_path, save_checkpoint
from qsync_lab.runtime.rank_context import run_settings, zoo_task
from qsync_lab.runtime.trainer import train

from .conftest import SHIPPED_PROFILE, cluster_file, one_rank_plan, write_plan

RANKS_UP_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_launch_leaves_no_rank_running(tmp_path, sig):
    """Ctrl-C (or a SIGTERM: ``timeout``, a job scheduler) in ``launch`` (``qsync-lab
    run``) stops torchrun and both ranks, each in a session of its own, which a SIGKILL to
    torchrun's process group would leave running."""
    plan = write_plan(tmp_path / "plan.json", "local-cpu", {}, model="digits_mlp",
                      task="synthetic")
    run_dir = tmp_path / "run"
    script = ("from qsync_lab.runtime.launch import launch\n"
              "from qsync_lab.runtime.options import TrainConfig\n"
              f"launch(TrainConfig(plan={str(plan)!r}, run_dir={str(run_dir)!r}, "
              "data='synthetic', steps=10**6, checkpoint_every=0), threads=1, progress=False)")
    job = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    ranks = []
    try:
        ranks = _ranks_when_up(run_dir, job, count=2)
        job.send_signal(sig)
        output, _ = job.communicate(timeout=STOP_TIMEOUT_S)
        left = [r.pid for r in ranks if _alive(r)]
    finally:
        job.kill()
        for rank in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.kill()
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in output
    else:
        assert job.returncode == 128 + signal.SIGTERM, output[-2000:]
    assert not left, f"ranks {left} still run"


def _ranks_when_up(run_dir, job: subprocess.Popen, count: int) -> list[psutil.Process]:
    """The ranks' processes, once all ``count`` have written their pid file."""
    deadline = time.monotonic() + RANKS_UP_TIMEOUT_S
    while len(files := sorted((run_dir / "ranks").glob("rank*.json"))) < count:
        assert job.poll() is None, job.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"{len(files)} of {count} ranks up"
        time.sleep(0.1)
    return [psutil.Process(json.loads(f.read_text())["pid"]) for f in files]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_ranks_notes_reach_the_terminal_and_no_old_summary_is_shown(tmp_path, monkeypatch,
                                                                       capsys):
    """The ranks' output goes to launch.log; their ``qsync_lab:`` notes (here after a
    progress bar's carriage return) are shown, and a summary this run did not write is not
    printed as its result, nor a line about another node."""
    plan = write_plan(tmp_path / "plan.json", "local-cpu", {}, model="digits_mlp",
                      task="synthetic")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text('{"steps": 3}')  # an earlier run's
    note = f"qsync_lab: --resume: no checkpoint in {run_dir}; starting from step 0"
    rank = f"import sys; print('train:   0%|  | 0/3\\r' + {note!r}, file=sys.stderr)"
    monkeypatch.setattr(launch, "torchrun_command", lambda *a, **k: [sys.executable, "-c", rank])
    code = main(["run", "--plan", str(plan), "--run-dir", str(run_dir), "--steps", "3",
                 "--resume"])
    out, err = capsys.readouterr()  # err: the launcher's progress bar, then the note
    assert (code, out) == (0, "")
    assert [line for line in err.splitlines() if "qsync_lab" in line] == [note]


@pytest.mark.parametrize("resume", [True, False], ids=["resumed", "fresh"])
def test_the_bar_counts_this_runs_steps(tmp_path, monkeypatch, capsys, resume):
    """An earlier run logged 2 steps and checkpointed step 2. Resumed, the bar starts at
    2/4 (not at 0/4, filling at a rate no step ran at); a fresh run starts at 0/4 and does
    not count the earlier run's lines. Either way it follows the ranks' lines."""
    plan = write_plan(tmp_path / "plan.json", "local-cpu", {}, model="digits_mlp",
                      task="synthetic")
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text('{"step": 0}\n{"step": 1}\n')
    _checkpoint(metrics.parent, plan, 2, steps=4)
    # the rank logs its first step: step 2 after the resumed ones, or step 0 afresh
    line, mode = ('{"step": 2}\n', "a") if resume else ('{"step": 0}\n', "w")
    rank = f"open({str(metrics)!r}, {mode!r}).write({line!r})"
    monkeypatch.setattr(launch, "torchrun_command", lambda *a, **k: [sys.executable, "-c", rank])
    main(["run", "--plan", str(plan), "--run-dir", str(metrics.parent), "--steps", "4",
          *(["--resume"] if resume else [])])
    bars = [part for part in capsys.readouterr().err.replace("\r", "\n").splitlines()
            if part.startswith("train:")]
    if resume:
        assert "2/4" in bars[0] and "3/4" in bars[-1]
        assert not any("0/4" in bar or "1/4" in bar for bar in bars)
    else:
        assert "0/4" in bars[0] and "1/4" in bars[-1]
        assert not any("2/4" in bar for bar in bars)


def test_the_bars_time_starts_at_the_first_step(tmp_path, monkeypatch, capsys):
    """The ranks take 4 s to start, then log 3 steps 0.2 s apart: the bar's elapsed time
    and rate are the steps', not the start-up's."""
    plan = write_plan(tmp_path / "plan.json", "local-cpu", {}, model="digits_mlp",
                      task="synthetic")
    metrics = tmp_path / "run" / "metrics.jsonl"
    rank = ("import time\ntime.sleep(4)\nfor step in range(3):\n"
            f"    open({str(metrics)!r}, 'a').write('{{}}\\n')\n    time.sleep(0.2)\n")
    monkeypatch.setattr(launch, "torchrun_command", lambda *a, **k: [sys.executable, "-c", rank])
    main(["run", "--plan", str(plan), "--run-dir", str(metrics.parent), "--steps", "3"])
    last = capsys.readouterr().err.replace("\r", "\n").split("train:")[-1]
    minutes, seconds = re.search(r"\[(\d+):(\d+)<", last).groups()
    assert "3/3" in last and int(minutes) * 60 + int(seconds) < 3, last


def _checkpoint(run_dir, plan, step: int, **options) -> None:
    """A checkpoint at ``step`` of the run that ``TrainConfig(plan, run_dir, **options)``
    makes, holding no state (the launcher reads only its manifest)."""
    config, loaded = TrainConfig(str(plan), str(run_dir), **options), Plan.load(plan)
    save_checkpoint(checkpoint_path(run_dir, step), {}, {
        "step": step, "settings": run_settings(config, loaded, zoo_task(config, loaded))})


def test_a_resume_is_checked_before_any_process_starts(tmp_path, single_rank_group,
                                                        monkeypatch, capsys):
    """A complete run is a note and a refused resume one line, with no process started;
    what a rank resumes, the launcher lets through (it checks the same settings)."""
    plan, run_dir = one_rank_plan(tmp_path), tmp_path / "run"
    train(TrainConfig(str(plan), str(run_dir), steps=2, checkpoint_every=2,
                      profiles=(SHIPPED_PROFILE,)))
    started = []
    monkeypatch.setattr(launch, "torchrun_command",
                        lambda *a, **k: started.append(a) or [sys.executable, "-c", ""])

    def run(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        code = main(["run", "--plan", str(plan), "--run-dir", str(run_dir), "--resume",
                     "--checkpoint-every", "2", *args])
        return code, capsys.readouterr().err

    assert run("--steps", "2") == (0, "qsync_lab: run already complete at step 2; nothing to "
                                      "do\n")
    code, err = run("--steps", "3")
    assert (code, err.splitlines()) == (2, [
        "qsync-lab: error: --resume: this run changes steps 2 -> 3 from its checkpoint; pass "
        "--allow-change steps to go on so, or resume with the checkpoint's values"])
    code, err = run("--steps", "2", "--lr", "0.1", "--momentum", "0.5")
    assert (code, err.splitlines()) == (2, [
        "qsync-lab: error: --resume: this run differs from its checkpoint in: lr 0.05 -> 0.1, "
        "momentum 0.9 -> 0.5; start a fresh --run-dir"])
    assert started == []
    run("--steps", "3", "--allow-change", "steps")
    assert len(started) == 1


def test_two_ranks_errors_on_one_line_give_one(tmp_path):
    log = tmp_path / "launch.log"
    error = "--resume: this run differs from its checkpoint in: lr 0.05 -> 0.01"
    log.write_text(f"qsync_lab.runtime: error: {error}qsync_lab.runtime: error: {error}\n")
    assert launch.rank_error(log) == error


#: what torchrun 2.x wrote to launch.log when both ranks raised (captured from a real run):
#: the banner, the ranks' tracebacks, torchrun's own, whose ChildFailedError line is empty
TORCHRUN_FAILURE_LOG = """
*****************************************
Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being overloaded, please further tune the variable for optimal performance in your application as needed.
*****************************************
Traceback (most recent call last):
  File "/work/qsync_lab/runtime/__main__.py", line 55, in <module>
    exit_rank(main())
  File "/work/qsync_lab/quant/gemm.py", line 88, in fp8_matmul
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
RuntimeError: Multiplication of two Float8_e5m2 matrices is not supported
Traceback (most recent call last):
  File "/work/qsync_lab/runtime/trainer.py", line 327, in _step
    (loss * weight).backward()
RuntimeError: Connection closed by peer [127.0.0.1]:29500
W1127 18:00:31.885000 4979 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 4985 closing signal SIGTERM
E1127 18:00:31.901000 4979 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 4986) of binary: /work/.venv/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/work/.venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
qsync_lab.runtime FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_18:00:31
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4985)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""
FP8_ERROR = "RuntimeError: Multiplication of two Float8_e5m2 matrices is not supported"


def test_a_ranks_exception_reaches_the_terminal_as_its_last_line(tmp_path):
    """Not torchrun's empty ``ChildFailedError:`` line: the first rank's exception (the
    second rank's is its peer's loss); torchrun's ``[rank0]:`` prefixes are read through."""
    log = tmp_path / "launch.log"
    log.write_text(TORCHRUN_FAILURE_LOG)
    assert launch.rank_error(log) == FP8_ERROR
    banner, rest = TORCHRUN_FAILURE_LOG.split("Traceback", 1)
    ranks, torchrun = ("Traceback" + rest).split("W1127", 1)
    log.write_text(banner + "".join(f"[rank0]: {line}\n" for line in ranks.splitlines())
                   + "W1127" + torchrun)
    assert launch.rank_error(log) == FP8_ERROR


def test_the_runtimes_own_error_line_wins_and_no_error_is_ever_empty(tmp_path):
    log = tmp_path / "launch.log"
    log.write_text("qsync_lab.runtime: error: non-finite loss on rank 1 at step 3\n"
                   + TORCHRUN_FAILURE_LOG)
    assert launch.rank_error(log) == "non-finite loss on rank 1 at step 3"
    torchrun_only = TORCHRUN_FAILURE_LOG[TORCHRUN_FAILURE_LOG.index("W1127"):]
    log.write_text(torchrun_only)
    assert launch.rank_error(log).startswith("traceback : To enable traceback")
    for text in ("", "\n=====\n", "torch.distributed.elastic.multiprocessing.errors."
                 "ChildFailedError: \n"):
        log.write_text(text)
        assert launch.rank_error(log).strip(), repr(text)


def test_a_failed_run_is_one_line_with_the_ranks_exception(tmp_path, monkeypatch):
    """``launch`` raises the ranks' exception, as read from the log torchrun wrote."""
    plan = write_plan(tmp_path / "plan.json", "local-cpu", {}, model="digits_mlp",
                      task="synthetic")
    script = tmp_path / "torchrun.py"
    script.write_text(f"import sys\nsys.stdout.write({TORCHRUN_FAILURE_LOG!r})\nsys.exit(1)\n")
    monkeypatch.setattr(launch, "torchrun_command", lambda *a, **k: [sys.executable, str(script)])
    config = TrainConfig(plan=str(plan), run_dir=str(tmp_path / "run"), data="synthetic",
                         steps=2)
    with pytest.raises(QSyncError) as err:
        launch.launch(config, progress=False)
    assert str(err.value).startswith(f"the run failed (torchrun exit 1): {FP8_ERROR}; the full "
                                     "log is ")
    assert "\n" not in str(err.value)


# --- what this machine cannot run: refused before any process starts ---------------------


def _no_process(monkeypatch):
    """Fail the test if the launcher starts a process."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(launch.subprocess, "Popen", refuse)


@pytest.fixture(scope="module")
def paper_plan(tmp_path_factory):
    """The digits MLP on the paper cluster: 32 ranks of V100 and T4, global batch 1024."""
    return write_plan(tmp_path_factory.mktemp("paper") / "plan.json", "qsync-paper", {},
                      model="digits_mlp", task="synthetic")


@pytest.fixture(scope="module")
def gpu_plan(tmp_path_factory):
    """A 2-rank V100 + T4 plan whose cluster does not emulate them."""
    folder = tmp_path_factory.mktemp("gpu")
    cluster = cluster_file(folder, ['{ kind = "V100-SXM2-32GB", count = 1 }',
                                    '{ kind = "T4", count = 1 }'], name="v100-t4")
    return write_plan(folder / "plan.json", cluster, {}, model="digits_mlp", task="synthetic")


def _refused(capsys, plan, *extra):
    code = main(["run", "--plan", str(plan), "--run-dir", str(plan.parent / "run"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("qsync-lab: error: ") and err.count("\n") == 1, err
    assert not (plan.parent / "run").exists()
    return err


def test_a_32_rank_plan_is_refused_on_2_cores_before_any_process(paper_plan, capsys,
                                                                 monkeypatch):
    _no_process(monkeypatch)
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)
    err = _refused(capsys, paper_plan)
    assert "the plan starts 32 ranks here and this machine has 2 cores (at most 4" in err
    assert "--cluster local-hybrid" in err and "--oversubscribe" in err
    monkeypatch.setattr(machine, "cuda_here", lambda: False)
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 16)  # 32 ranks on 16 cores: 2 each
    assert "no CUDA" in _refused(capsys, paper_plan)


def test_gpu_ranks_without_cuda_are_refused_with_the_way_out(gpu_plan, paper_plan, capsys,
                                                             monkeypatch):
    _no_process(monkeypatch)
    monkeypatch.setattr(machine, "cuda_here", lambda: False)
    err = _refused(capsys, gpu_plan)
    assert "runs 2 of its 2 ranks as V100-SXM2-32GB/T4 GPUs and this machine has no CUDA" in err
    assert "pass --emulate" in err and "--cluster local-hybrid" in err
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)  # past the cores: the devices
    assert "no CUDA" in _refused(capsys, paper_plan, "--oversubscribe")


def test_a_training_set_smaller_than_one_global_batch_is_refused(paper_plan, capsys,
                                                                 monkeypatch):
    _no_process(monkeypatch)
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 16)
    err = _refused(capsys, paper_plan, "--emulate", "--data", "synthetic")
    assert ("the synthetic task's training set has 512 samples, fewer than the plan's global "
            "batch (1024)") in err and "re-plan for a cluster with fewer ranks" in err


def test_emulate_passes_the_checks_and_reaches_the_ranks(gpu_plan, monkeypatch):
    """With --emulate a GPU plan on this CPU is checked in full and started, the ranks told
    to emulate (``--emulate`` in their arguments)."""
    monkeypatch.setattr(machine, "cuda_here", lambda: False)
    config = TrainConfig(plan=str(gpu_plan), run_dir=str(gpu_plan.parent / "run"),
                         data="synthetic", emulate=True)
    assert launch.check_run(config).world_size == 2
    assert "--emulate" in runtime_argv(config)


def test_the_refusals_come_in_a_fresh_process_before_torch_is_imported(paper_plan, tmp_path):
    """The 32-rank plan on 512 samples refused for this machine's cores (2 here), else its
    devices (no CUDA), else the data, whatever the machine, by a process in which torch
    cannot be imported (a stand-in that raises is first on its path)."""
    if machine._NVIDIA_DRIVER.exists():
        pytest.skip("with an NVIDIA driver, asking for CUDA imports torch")
    shim = tmp_path / "no_torch"
    shim.mkdir()
    (shim / "torch.py").write_text("raise ImportError('torch was imported')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(shim), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "qsync_lab", "run", "--plan", str(paper_plan),
                           "--run-dir", str(tmp_path / "run"), "--data", "synthetic"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert any(why in done.stderr for why in ("cores", "no CUDA", "512 samples")), done.stderr
    assert not (tmp_path / "run").exists()


def test_an_emulated_run_is_predicted_as_its_cluster_emulating_on_this_cpu(gpu_plan, tmp_path):
    """``on_cpu``: the V100 + T4 ranks costed as this CPU over loopback, exactly as a
    cluster that says so (``emulate_on = "cpu"``, ``local-hybrid``'s way) is."""
    from qsync_lab.costs import load_cost_model
    from qsync_lab.plan import Plan
    from qsync_lab.runtime.prediction import predict_plan, run_profiles

    plan = Plan.load(gpu_plan)
    graph = launch._model_graph("digits_mlp", {})
    costs = load_cost_model(*run_profiles())
    declared = cluster_file(tmp_path, ['{ kind = "V100-SXM2-32GB", count = 1, emulate_on = "cpu" }',
                                       '{ kind = "T4", count = 1, emulate_on = "cpu" }'])
    emulated = Plan.load(write_plan(tmp_path / "emulated.json", declared, {},
                                    model="digits_mlp", task="synthetic"))
    on_cpu = predict_plan(plan, graph, costs, on_cpu=True).iteration_us
    assert on_cpu == pytest.approx(predict_plan(emulated, graph, costs).iteration_us)
    assert on_cpu != pytest.approx(predict_plan(plan, graph, costs).iteration_us)


def test_the_summary_line_says_what_was_predicted_and_what_the_accuracy_means():
    summary = {"model": "digits_mlp", "cluster": "v100-t4", "steps": 20, "task": "mnist1d",
               "test_accuracy": 0.0, "chance_accuracy": 0.112, "test_loss": 2.3,
               "measured_step_ms": 4.0, "predicted_step_ms": 3.8, "step_error_pct": -5.0,
               "measured_tensor_peak_mib": 2.0, "predicted_tensor_peak_mib": 2.1,
               "emulating": ["V100-SXM2-32GB", "T4"],
               "plan_made_under": "qsync (optimizer sgd_momentum, compression none) under "
                                  "memory V100-SXM2-32GB 32 GiB (device memory), T4 1 GiB"}
    line = summary_line(summary)
    assert "predicted for this CPU emulating V100-SXM2-32GB/T4 3.80 ms (-5.0 %)" in line
    assert "test accuracy 0.0000, not above chance (0.1120): not learned in 20 steps" in line
    assert line.endswith("; plan: qsync (optimizer sgd_momentum, compression none) under "
                         "memory V100-SXM2-32GB 32 GiB (device memory), T4 1 GiB")
    synthetic = summary_line({**summary, "task": "synthetic", "emulating": []})
    assert "accuracy" not in synthetic.replace("no accuracy: the synthetic task has random "
                                               "labels", "")
    assert "predicted 3.80 ms" in synthetic
    learned = summary_line({**summary, "test_accuracy": 0.9})
    assert "test accuracy 0.9000 (chance 0.1120)" in learned
