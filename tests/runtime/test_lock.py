"""One run per directory: the launcher's lock, held by torchrun for its life, refused to a
second launch (naming the holder) and taken over with a note once its holder is gone."""

import os
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest

from qsync_lab.cli import main
from qsync_lab.errors import QSyncError
from qsync_lab.runtime import launch
from qsync_lab.runtime.lock import (LOCK_ENV, LOCK_HELD, LOCK_NAME, RunLockTakeoverWarning,
                                    acquire_run_lock, check_run_dir_free, forget_ended_holder,
                                    lock_for_this_process)
from qsync_lab.runtime.options import TrainConfig

from .conftest import write_plan

CHILD_UP_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    return write_plan(tmp_path_factory.mktemp("plan") / "plan.json", "local-cpu", {},
                      model="digits_mlp", task="synthetic")


def test_a_second_launch_on_a_locked_directory_is_refused_naming_the_holder(
        plan_file, tmp_path, capsys, monkeypatch):
    """At once: before the model is built and traced (seconds for a large one)."""
    run_dir = tmp_path / "run"
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    monkeypatch.setattr(launch, "_model_graph", lambda *a: pytest.fail("the model was built"))
    with acquire_run_lock(run_dir):
        code = main(["run", "--plan", str(plan_file), "--run-dir", str(run_dir)])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1
    assert (f"run directory {run_dir} is in use by pid {os.getpid()} on host "
            f"{socket.gethostname()} since ") in err
    assert err.rstrip().endswith("; wait for it or choose another --run-dir")
    assert not started and not (run_dir / launch.LOG_NAME).exists()


def test_torchrun_holds_the_lock_for_its_whole_life(plan_file, tmp_path, monkeypatch):
    """The launcher passes its descriptor to torchrun (here a stand-in that records its
    environment and waits) and lets go: the lock lives exactly as long as the child."""
    run_dir, seen = tmp_path / "run", tmp_path / "env.txt"
    child = ("import os, pathlib, time; "
             f"pathlib.Path({str(seen)!r}).write_text(os.environ.get({LOCK_ENV!r}, '')); "
             "time.sleep(120)")
    monkeypatch.setattr(launch, "torchrun_command", lambda *a, **k: [sys.executable, "-c", child])
    job = launch.start(TrainConfig(plan=str(plan_file), run_dir=str(run_dir)))
    try:
        _wait_for(seen, job)
        assert seen.read_text() == LOCK_HELD
        with pytest.raises(QSyncError, match=f"is in use by pid {job.pid} on host"):
            acquire_run_lock(run_dir)
    finally:
        job.kill()
        job.wait()
    with pytest.warns(RunLockTakeoverWarning, match=f"from pid {job.pid} on host .*which has "
                      "ended"):
        acquire_run_lock(run_dir).release()


def test_a_finished_launch_leaves_the_lock_free_and_unrecorded(plan_file, tmp_path,
                                                              monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setattr(launch, "torchrun_command", lambda *a, **k: [sys.executable, "-c", ""])
    assert launch.launch(TrainConfig(plan=str(plan_file), run_dir=str(run_dir)),
                         progress=False) is None  # no summary: the stand-in trained nothing
    assert (run_dir / LOCK_NAME).read_text() == ""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no takeover note
        acquire_run_lock(run_dir).release()


def test_a_failed_launch_leaves_the_lock_free_and_unrecorded(plan_file, tmp_path, monkeypatch):
    """torchrun exited with an error, but it did end: the next run needs no takeover note."""
    run_dir = tmp_path / "run"
    monkeypatch.setattr(launch, "torchrun_command",
                        lambda *a, **k: [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(QSyncError, match=r"the run failed \(torchrun exit 3\)"):
        launch.launch(TrainConfig(plan=str(plan_file), run_dir=str(run_dir)), progress=False)
    assert (run_dir / LOCK_NAME).read_text() == ""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no takeover note
        acquire_run_lock(run_dir).release()


def test_a_lock_whose_holder_was_killed_is_taken_over_with_a_note(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.run(
        [sys.executable, "-c", "import os, signal, sys\n"
         "from qsync_lab.runtime.lock import acquire_run_lock\n"
         "acquire_run_lock(sys.argv[1])\nos.kill(os.getpid(), signal.SIGKILL)", str(run_dir)],
        capture_output=True, text=True, timeout=60)
    assert holder.returncode == -signal.SIGKILL, holder.stderr
    with pytest.warns(RunLockTakeoverWarning) as notes:
        lock = acquire_run_lock(run_dir)
    note = str(notes[0].message)
    assert note.startswith(f"took over the lock of run directory {run_dir} from pid ")
    assert f"on host {socket.gethostname()} since " in note and "\n" not in note
    with pytest.raises(QSyncError, match=f"in use by pid {os.getpid()} "):
        acquire_run_lock(run_dir)  # this process holds it now
    lock.release()


def test_a_holder_that_lets_go_leaves_no_note(tmp_path):
    """A clean release (a run in this process) or a finished launch (forget_ended_holder
    after torchrun exits 0) clears the record, so the next run starts without a note."""
    acquire_run_lock(tmp_path).release()
    assert (tmp_path / LOCK_NAME).read_text() == ""
    inherited = os.dup((lock := acquire_run_lock(tmp_path)).fd)  # as torchrun inherits it
    lock.hand_over(4242)
    forget_ended_holder(tmp_path)  # still held: nothing to do
    assert '"pid": 4242' in (tmp_path / LOCK_NAME).read_text()
    os.close(inherited)  # "torchrun" ends, never letting go itself
    forget_ended_holder(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acquire_run_lock(tmp_path).release()


def test_a_symlink_in_place_of_the_lock_file_is_refused(tmp_path):
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / LOCK_NAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(QSyncError, match="refusing to use the symlink .* as the run lock"):
        acquire_run_lock(tmp_path)
    assert (tmp_path / "elsewhere").read_text() == ""


def test_rank_0_takes_the_lock_only_when_the_launcher_does_not_hold_it(tmp_path, monkeypatch):
    monkeypatch.setenv(LOCK_ENV, LOCK_HELD)
    assert lock_for_this_process(tmp_path) is None
    assert not (tmp_path / LOCK_NAME).exists()
    monkeypatch.delenv(LOCK_ENV)
    with lock_for_this_process(tmp_path) as lock:
        assert lock.path == tmp_path / LOCK_NAME
        with pytest.raises(QSyncError, match="is in use by pid"):
            acquire_run_lock(tmp_path)


def _wait_for(path, job: subprocess.Popen) -> None:
    deadline = time.monotonic() + CHILD_UP_TIMEOUT_S
    while not path.exists() or not path.read_text():
        assert job.poll() is None, f"the child ended with {job.returncode}"
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.05)


def test_a_study_run_on_a_locked_directory_keeps_the_running_plan(tmp_path):
    from qsync_lab import Study
    from qsync_lab.plan import Plan

    study = Study("digits_cnn", cluster="local-hybrid", progress=False)
    plan = Plan.build(study.graph, study.cluster, {}, model_name="digits_cnn")
    run_dir = tmp_path / "run"
    with acquire_run_lock(run_dir):
        with pytest.raises(QSyncError, match=f"run directory {run_dir} is in use by pid"):
            study.run(plan, steps=2, run_dir=run_dir)
    assert not (run_dir / "plan.json").exists()
    check_run_dir_free(run_dir)  # free again once released
