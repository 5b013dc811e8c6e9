import json
import time

import psutil
import pytest

from qsync_lab.cluster import load_cluster
from qsync_lab.errors import QSyncError
from qsync_lab.widgets import LocalRun, read_new_metrics, runs_here

RUN_START_TIMEOUT_S = 180


def test_metrics_are_read_line_by_line_as_the_file_grows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_new_metrics(path, 0) == ([], 0)
    path.write_text('{"step": 0}\n{"step": 1, "lo')
    records, offset = read_new_metrics(path, 0)
    assert records == [{"step": 0}] and offset == 12
    with path.open("a") as handle:
        handle.write('ss": 0.5}\nnot json\n{"step": 2}\n')
    records, offset = read_new_metrics(path, offset)
    assert records == [{"step": 1, "loss": 0.5}, {"step": 2}]
    assert offset == path.stat().st_size
    assert read_new_metrics(path, offset) == ([], offset)


def test_only_clusters_this_machine_emulates_run_here(study, tmp_path):
    assert runs_here(load_cluster("local-hybrid")) and runs_here(load_cluster("local-cpu"))
    assert not runs_here(load_cluster("v100-t4-small"))
    real = study.on_cluster("v100-t4-small")
    with pytest.raises(QSyncError, match="does not emulate"):
        LocalRun(real, real.plan(strategy="fp32"), tmp_path, steps=2)
    assert not list(tmp_path.iterdir())


def test_a_local_run_streams_its_metrics_and_cancel_leaves_no_process(tuner):
    tuner.steps.value = 100_000
    tuner.run_button.click()
    run = tuner.local_run
    assert tuner.run_button.disabled and not tuner.cancel_button.disabled
    try:
        deadline = time.monotonic() + RUN_START_TIMEOUT_S
        while not _loss_points(tuner) and time.monotonic() < deadline:
            assert run.process.poll() is None, (run.run_dir / "launch.log").read_text()[-2000:]
            time.sleep(0.2)
        launcher = psutil.Process(run.process.pid)
        processes = [launcher, *launcher.children(recursive=True)]
    finally:
        tuner.cancel_button.click()
    tuner.run_thread.join(30)
    assert _loss_points(tuner), "no step was drawn"
    ranks = [json.loads(p.read_text())["pid"] for p in (run.run_dir / "ranks").glob("*.json")]
    assert len(ranks) == 2 and set(ranks) <= {p.pid for p in processes}
    assert not [p for p in processes if _alive(p)]
    assert not tuner.run_thread.is_alive()
    assert tuner.run_status.value.startswith("cancelled after")
    assert not tuner.run_button.disabled and tuner.cancel_button.disabled
    predicted = next(t for t in tuner.figures["live"].data if t.name == "predicted")
    assert list(predicted.y) == pytest.approx([run.predicted_step_ms] * 2)


def _loss_points(tuner) -> int:
    return sum(len(t.x) for t in tuner.figures["live"].data if t.name == "loss")


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
