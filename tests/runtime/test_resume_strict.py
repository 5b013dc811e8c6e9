"""``--resume`` continues the same run or refuses: complete runs say so and exit 0, other
settings are named in one line, more steps continue bit for bit."""

import pytest
import torch

from qsync_lab.errors import QSyncError
from qsync_lab.runtime.__main__ import main
from qsync_lab.runtime.checkpoint import checkpoint_path
from qsync_lab.runtime.metrics import read_metrics
from qsync_lab.runtime.trainer import TrainConfig, train
from tests.runtime.conftest import final_parameters, one_rank_plan


def test_resuming_a_complete_run_says_so_and_changes_nothing(tmp_path, single_rank_group,
                                                             capsys):
    plan, run = one_rank_plan(tmp_path), tmp_path / "run"
    train(TrainConfig(str(plan), str(run), steps=4, checkpoint_every=2))
    before = {name: (run / name).read_bytes() for name in ("summary.json", "metrics.jsonl",
                                                            "final.safetensors")}
    capsys.readouterr()
    assert train(TrainConfig(str(plan), str(run), steps=4, checkpoint_every=2,
                             resume=True)) is None
    assert "run already complete at step 4; nothing to do" in capsys.readouterr().err
    # fewer steps than the checkpoint's, through the command line: exit status 0
    assert main(["--plan", str(plan), "--run-dir", str(run), "--steps", "3", "--resume",
                 "--threads", str(torch.get_num_threads())]) == 0
    assert "run already complete at step 4" in capsys.readouterr().err
    assert {name: (run / name).read_bytes() for name in before} == before


def test_resuming_with_other_settings_is_refused_naming_each(tmp_path, single_rank_group):
    plan, run = one_rank_plan(tmp_path), tmp_path / "run"
    train(TrainConfig(str(plan), str(run), steps=2, checkpoint_every=2, optimizer="sgd"))
    saved = checkpoint_path(run, 2).read_bytes()
    with pytest.raises(QSyncError) as err:  # adamw on an SGD checkpoint: no KeyError
        train(TrainConfig(str(plan), str(run), steps=4, resume=True, seed=1, lr=0.1,
                          optimizer="adamw", data="synthetic"))
    assert str(err.value) == ("--resume: this run differs from its checkpoint in: seed 0 -> 1, "
                              "lr 0.05 -> 0.1, optimizer sgd -> adamw, data digits -> "
                              "synthetic; start a fresh --run-dir")
    assert checkpoint_path(run, 2).read_bytes() == saved


def test_more_steps_and_harmless_options_continue_bit_for_bit(tmp_path, single_rank_group):
    plan = one_rank_plan(tmp_path, {"cpu": {"fc1": "int8"}})
    whole, split = tmp_path / "whole", tmp_path / "split"
    uninterrupted = train(TrainConfig(str(plan), str(whole), steps=6, checkpoint_every=3))
    train(TrainConfig(str(plan), str(split), steps=3, checkpoint_every=3))
    resumed = train(TrainConfig(str(plan), str(split), steps=6, resume=True, checkpoint_every=2,
                                keep_checkpoints=1, warmup_steps=0))
    assert resumed["resumed_from"] == 3
    assert [r["step"] for r in read_metrics(split / "metrics.jsonl")] == list(range(6))
    assert resumed["ranks"][0]["params_sha256"] == uninterrupted["ranks"][0]["params_sha256"]
    a, b = final_parameters(whole), final_parameters(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [p.name for p in split.glob("checkpoint-*")] == [checkpoint_path(split, 6).name]


def test_resume_notes_what_it_could_not_find(tmp_path, single_rank_group, capsys):
    """No checkpoint after an earlier attempt: a note, then step 0; a complete run whose
    summary was never written: the note says so."""
    plan, run = one_rank_plan(tmp_path), tmp_path / "run"
    train(TrainConfig(str(plan), str(run), steps=2, checkpoint_every=0))
    capsys.readouterr()
    train(TrainConfig(str(plan), str(run), steps=2, checkpoint_every=2, resume=True))
    assert f"--resume: no checkpoint in {run}" in capsys.readouterr().err
    (run / "summary.json").unlink()
    assert train(TrainConfig(str(plan), str(run), steps=2, resume=True)) is None
    assert "summary.json is missing" in capsys.readouterr().err
