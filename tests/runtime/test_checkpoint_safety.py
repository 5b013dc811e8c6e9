"""Checkpoints are safe and verified: nothing is unpickled, damage is found by the sha256 and
the previous checkpoint used, old ones are pruned, a legacy pickle is refused, a manifest
without a step is refused and a FIFO or folder named like a checkpoint is left alone."""

import os
import pathlib
import pickle
import subprocess
import sys
import time

import pytest
import torch

from qsync_lab.errors import QSyncError
from qsync_lab.runtime.checkpoint import (checkpoint_path, latest_valid_checkpoint,
                                          load_checkpoint, prune_checkpoints, save_checkpoint)
from qsync_lab.runtime.metrics import read_metrics
from qsync_lab.runtime.trainer import TrainConfig, train
from tests.runtime.conftest import one_rank_plan

FIFO_GRACE_S = 5


class _Payload:
    """Unpickling it creates ``marker``: the code a hostile checkpoint would run."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def _one_line(err: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(err.value)
    return str(err.value)


def test_the_state_round_trips_with_its_types(tmp_path):
    shared = torch.arange(6.0)
    state = {"model": {"a": shared, "tied": shared, "half": torch.ones(3, dtype=torch.bfloat16),
                       "strided": torch.ones(4, 3).t()},
             "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "betas": (0.9, 0.99)},
             "python": (3, (1, 2), None), "counters": {"fc1": 7}}
    save_checkpoint(tmp_path / "c.safetensors", state, {"step": 5, "settings": {"seed": 0}})
    saved = load_checkpoint(tmp_path / "c.safetensors")
    assert saved.step == 5 and saved.manifest["settings"] == {"seed": 0}
    assert len(saved.manifest["sha256"]) == 64
    model = saved.state["model"]
    assert torch.equal(model["a"], shared) and torch.equal(model["tied"], shared)
    assert model["half"].dtype == torch.bfloat16 and torch.equal(model["strided"], torch.ones(3, 4))
    assert list(saved.state["optimizer"]["state"]) == [0]  # int keys stay ints
    assert saved.state["optimizer"]["betas"] == (0.9, 0.99)
    assert saved.state["python"] == (3, (1, 2), None) and saved.state["counters"] == {"fc1": 7}


@pytest.mark.parametrize("write", [
    lambda path, payload: path.write_bytes(pickle.dumps(payload)),
    lambda path, payload: torch.save({"model": payload}, path)], ids=["pickle", "torch.save"])
def test_a_pickle_is_refused_and_its_payload_never_runs(tmp_path, write):
    marker = tmp_path / "payload-ran"
    path = checkpoint_path(tmp_path, 10)
    write(path, _Payload(marker))
    with pytest.raises(QSyncError, match="is not a qsync_lab checkpoint") as err:
        load_checkpoint(path)
    assert "start a fresh --run-dir" in _one_line(err)
    assert not marker.exists()


def test_a_pickle_posing_as_the_newest_checkpoint_is_skipped(tmp_path):
    marker = tmp_path / "payload-ran"
    save_checkpoint(checkpoint_path(tmp_path, 10), {"w": torch.ones(2)}, {"step": 10})
    checkpoint_path(tmp_path, 20).write_bytes(pickle.dumps(_Payload(marker)))
    notes = []
    assert latest_valid_checkpoint(tmp_path, warn=notes.append).step == 10
    assert len(notes) == 1 and "checkpoint-00000020.safetensors is not a qsync_lab " \
        "checkpoint" in notes[0] and notes[0].endswith("resuming from checkpoint-00000010.safetensors")
    assert "fresh" not in notes[0] and "without --resume" not in notes[0]  # it does resume
    assert not marker.exists()


def test_a_legacy_checkpoint_pt_is_refused_in_one_line(tmp_path, single_rank_group):
    marker = tmp_path / "payload-ran"
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"format": 1, "step": 2, "model": _Payload(marker)}, run / "checkpoint.pt")
    with pytest.raises(QSyncError, match="checkpoint.pt is a pickle checkpoint of an older "
                       "qsync_lab") as err:
        train(TrainConfig(str(one_rank_plan(tmp_path)), str(run), steps=4, resume=True))
    assert _one_line(err).endswith("start a fresh --run-dir or re-run without --resume")
    assert not marker.exists()


def _flip_a_tensor_byte(path):
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # the last tensor's bytes
    path.write_bytes(bytes(data))


def _flip_a_digit_of_the_json_state(path):
    data = path.read_bytes()
    at = data.index(b"numpy", data.index(b"qsync_lab.state"))  # in the MT19937 state
    at += next(i for i, b in enumerate(data[at:]) if chr(b) in "123456789")
    path.write_bytes(data[:at] + (b"1" if data[at:at + 1] != b"1" else b"2") + data[at + 1:])


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.parametrize("damage, found", [
    (_flip_a_tensor_byte, "fails its sha256 check"),
    (_flip_a_digit_of_the_json_state, "fails its sha256 check"),
    (_truncate, "is not a qsync_lab checkpoint")], ids=["tensor-byte", "json-digit", "truncated"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous(tmp_path, single_rank_group,
                                                               capsys, damage, found):
    plan, run = one_rank_plan(tmp_path), tmp_path / "run"
    train(TrainConfig(str(plan), str(run), steps=4, checkpoint_every=2))
    damage(checkpoint_path(run, 4))
    capsys.readouterr()
    summary = train(TrainConfig(str(plan), str(run), steps=5, checkpoint_every=2, resume=True,
                                allow_change=("steps",)))
    notes = [line for line in capsys.readouterr().err.splitlines() if "qsync_lab:" in line]
    assert len(notes) == 1 and f"checkpoint-00000004.safetensors {found}" in notes[0], notes
    assert notes[0].endswith("resuming from checkpoint-00000002.safetensors")
    assert summary["resumed_from"] == 2
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(5))


def test_no_valid_checkpoint_is_an_error_never_a_fresh_start(tmp_path, single_rank_group):
    plan, run = one_rank_plan(tmp_path), tmp_path / "run"
    train(TrainConfig(str(plan), str(run), steps=4, checkpoint_every=2))
    for step in (2, 4):
        _truncate(checkpoint_path(run, step))
    metrics = (run / "metrics.jsonl").read_text()
    with pytest.raises(QSyncError, match=r"no valid checkpoint in .* \(2 tried, the newest: "
                       r".*checkpoint-00000004.safetensors is not a qsync_lab checkpoint") as err:
        train(TrainConfig(str(plan), str(run), steps=6, checkpoint_every=2, resume=True))
    assert _one_line(err).endswith("start a fresh --run-dir or re-run without --resume")
    assert (run / "metrics.jsonl").read_text() == metrics


def test_the_last_k_checkpoints_are_kept_and_later_leftovers_removed(tmp_path,
                                                                      single_rank_group):
    run = tmp_path / "run"
    save_checkpoint(checkpoint_path(run, 99), {}, {"step": 99})  # an earlier run's
    train(TrainConfig(str(one_rank_plan(tmp_path)), str(run), steps=6, checkpoint_every=1,
                      keep_checkpoints=3))
    assert sorted(p.name for p in run.glob("checkpoint-*")) == [
        checkpoint_path(run, step).name for step in (4, 5, 6)]
    assert load_checkpoint(checkpoint_path(run, 6)).manifest["settings"]["world_size"] == 1


def test_a_manifest_without_a_step_is_refused_in_one_line(tmp_path):
    path = checkpoint_path(tmp_path, 5)
    save_checkpoint(path, {"w": torch.ones(2)}, {"settings": {}})  # its sha256 is valid
    with pytest.raises(QSyncError, match="has no step or no settings table in its manifest; "
                       "start a fresh --run-dir") as err:
        load_checkpoint(path)
    _one_line(err)


def test_a_fifo_or_folder_named_like_a_checkpoint_is_left_alone(tmp_path):
    """Opening a FIFO to read it waits for a writer, the GIL held: a helper process opens
    it for writing after FIFO_GRACE_S, so that a reader that blocks fails instead of
    hanging."""
    save_checkpoint(checkpoint_path(tmp_path, 10), {"w": torch.ones(2)}, {"step": 10})
    fifo, folder = checkpoint_path(tmp_path, 30), checkpoint_path(tmp_path, 20)
    os.mkfifo(fifo)
    folder.mkdir()
    unblocker = subprocess.Popen([sys.executable, "-c", _UNBLOCK, str(fifo), str(FIFO_GRACE_S)])
    notes, begin = [], time.monotonic()
    try:
        latest = latest_valid_checkpoint(tmp_path, warn=notes.append)
        with pytest.raises(QSyncError, match="checkpoint-00000030.safetensors is not a "
                           "regular file") as err:
            load_checkpoint(fifo)
    finally:
        unblocker.kill()
        unblocker.wait()
    assert time.monotonic() - begin < FIFO_GRACE_S, "reading the run folder blocked on the FIFO"
    assert latest.step == 10 and notes == []
    _one_line(err)
    prune_checkpoints(tmp_path, 10, keep=1)
    assert fifo.exists() and folder.is_dir()


_UNBLOCK = """
import os, sys, time
time.sleep(float(sys.argv[2]))
while True:  # a writer that comes and goes: a reader blocked on the FIFO reads its end
    try:
        os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader at the moment
        pass
    time.sleep(0.05)
"""
