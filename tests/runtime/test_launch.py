"""``qsync-lab run``'s launcher: Ctrl-C stops every rank; the ranks' notes reach the
terminal."""

import contextlib
import json
import signal
import subprocess
import sys
import time

import psutil

from qsync_lab.cli import main
from qsync_lab.runtime import launch

from .conftest import write_plan

RANKS_UP_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30


def test_an_interrupted_launch_leaves_no_rank_running(tmp_path):
    """Ctrl-C in ``launch`` (``qsync-lab run``) stops torchrun and both ranks, each in a
    session of its own, which a SIGKILL to torchrun's process group would leave running."""
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
        job.send_signal(signal.SIGINT)
        output, _ = job.communicate(timeout=STOP_TIMEOUT_S)
        left = [r.pid for r in ranks if _alive(r)]
    finally:
        job.kill()
        for rank in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.kill()
    assert "KeyboardInterrupt" in output
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
    (run_dir / "summary.json").write_text('{"steps": 3}')  # the finished run's
    note = "qsync_lab: run already complete at step 3; nothing to do"
    rank = f"import sys; print('train:   0%|  | 0/3\\r' + {note!r}, file=sys.stderr)"
    monkeypatch.setattr(launch, "torchrun_command", lambda *a, **k: [sys.executable, "-c", rank])
    code = main(["run", "--plan", str(plan), "--run-dir", str(run_dir), "--steps", "3",
                 "--resume"])
    out, err = capsys.readouterr()  # err: the launcher's progress bar, then the note
    assert (code, out) == (0, "")
    assert [line for line in err.splitlines() if "qsync_lab" in line] == [note]
