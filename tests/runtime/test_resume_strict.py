"""``--resume`` continues the same run or refuses: complete runs say so and exit 0, other
settings (the data's tensors among them) are named in one line, more steps and other
harmless options continue bit for bit only when ``--allow-change`` names them, and a
checkpoint that verifies but is not this run's is refused in one line."""

import dataclasses

import pytest
import torch

from qsync_lab.errors import QSyncError
from qsync_lab.resources import cache_dir
from qsync_lab.runtime.__main__ import main
from qsync_lab.runtime.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from qsync_lab.runtime.metrics import read_metrics
from qsync_lab.runtime.options import config_from_args, runtime_argv, runtime_parser
from qsync_lab.runtime.tasks import Task
from qsync_lab.runtime.trainer import TrainConfig, train
from tests.runtime.conftest import cluster_file, final_parameters, one_rank_plan

SHA = r"[0-9a-f]{16}\.\.\."


def test_resuming_a_complete_run_says_so_and_changes_nothing(tmp_path, single_rank_group,
                                                             capsys):
    plan, run = one_rank_plan(tmp_path), tmp_path / "run"
    train(TrainConfig(str(plan), str(run), steps=4, checkpoint_every=2))
    before = {name: (run / name).read_bytes() for name in ("summary.json", "metrics.jsonl",
                                                            "final.safetensors")}
    capsys.readouterr()
    assert train(TrainConfig(str(plan), str(run), steps=4, checkpoint_every=2,
                             resume=True)) is None
    assert "qsync_lab: run already complete at step 4; nothing to do" in capsys.readouterr().err
    # fewer steps than the checkpoint's, through the command line: exit status 0
    assert main(["--plan", str(plan), "--run-dir", str(run), "--steps", "3", "--resume",
                 "--threads", str(torch.get_num_threads())]) == 0
    assert "run already complete at step 4" in capsys.readouterr().err
    assert {name: (run / name).read_bytes() for name in before} == before


def test_resuming_with_other_settings_is_refused_naming_each(tmp_path, single_rank_group):
    """Before the rank times its model's ops: an adamw run would measure a profile of its
    own (the optimizer is part of the profile's key)."""
    plan, run = one_rank_plan(tmp_path), tmp_path / "run"
    train(TrainConfig(str(plan), str(run), steps=2, checkpoint_every=2, optimizer="sgd"))
    saved = checkpoint_path(run, 2).read_bytes()
    profiles = set((cache_dir() / "profiles").iterdir())
    with pytest.raises(QSyncError, match=(  # adamw on an SGD checkpoint: no KeyError
            rf"^--resume: this run differs from its checkpoint in: seed 0 -> 1, lr 0.05 -> "
            rf"0.1, optimizer sgd -> adamw, data digits -> synthetic, data_sha256 {SHA} -> "
            rf"{SHA}; start a fresh --run-dir$")):  # not steps: more is allowed with a flag
        train(TrainConfig(str(plan), str(run), steps=4, resume=True, seed=1, lr=0.1,
                          optimizer="adamw", data="synthetic"))
    assert checkpoint_path(run, 2).read_bytes() == saved
    assert set((cache_dir() / "profiles").iterdir()) == profiles


def _sign_task(scale: float) -> Task:
    """A user task named "sign" whatever its tensors (``scale`` changes them)."""
    x = torch.randn(96, 6, generator=torch.Generator().manual_seed(0)) * scale
    y = (x[:, 0] > 0).long()

    def build():
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    return Task("sign", "", build, (x[:64],), y[:64], (x[64:],), y[64:])


def test_other_data_under_the_same_name_is_refused(tmp_path, single_rank_group):
    from qsync_lab.cluster import load_cluster
    from qsync_lab.graph import trace_graph
    from qsync_lab.plan import Plan
    from qsync_lab.resources import data_file

    task, plan = _sign_task(1.0), tmp_path / "p.json"
    cluster = cluster_file(tmp_path, ['{ kind = "cpu", count = 1, batch_size = 16 }'])
    inputs, target = task.example(4)
    graph = trace_graph(task.build_model(), inputs, target=target, loss_fn=task.loss_fn())
    Plan.build(graph, load_cluster(cluster), {}).save(plan)
    config = TrainConfig(str(plan), str(tmp_path / "run"), steps=2, checkpoint_every=2,
                         profiles=(str(data_file("profiles", "cpu.csv")),))  # none measured
    train(config, task=task)
    with pytest.raises(QSyncError, match=rf"differs from its checkpoint in: data_sha256 {SHA} "
                       rf"-> {SHA}; start a fresh --run-dir$"):
        train(dataclasses.replace(config, steps=4, resume=True, allow_change=("steps",)),
              task=_sign_task(100.0))


def test_more_steps_and_harmless_options_continue_bit_for_bit_when_allowed(
        tmp_path, single_rank_group):
    plan = one_rank_plan(tmp_path, {"cpu": {"fc1": "int8"}})
    whole, split = tmp_path / "whole", tmp_path / "split"
    uninterrupted = train(TrainConfig(str(plan), str(whole), steps=6, checkpoint_every=3))
    train(TrainConfig(str(plan), str(split), steps=3, checkpoint_every=3))
    saved = checkpoint_path(split, 3).read_bytes()
    changes = {"steps": 6, "checkpoint_every": 2, "keep_checkpoints": 1, "warmup_steps": 0,
               "on_nonfinite": "skip"}
    with pytest.raises(QSyncError) as err:
        train(TrainConfig(str(plan), str(split), resume=True, **changes))
    assert str(err.value) == (
        "--resume: this run changes steps 3 -> 6, checkpoint_every 3 -> 2, keep_checkpoints "
        "2 -> 1, on_nonfinite stop -> skip, warmup_steps null -> 0 from its checkpoint; pass "
        "--allow-change steps,checkpoint-every,keep-checkpoints,on-nonfinite,warmup-steps to "
        "go on so, or resume with the checkpoint's values")
    assert checkpoint_path(split, 3).read_bytes() == saved
    resumed = train(TrainConfig(str(plan), str(split), resume=True, allow_change=tuple(changes),
                                **changes))
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


def test_allow_change_names_only_harmless_settings_and_round_trips():
    args = runtime_parser().parse_args(["--plan", "p.json", "--resume", "--allow-change",
                                        "steps,checkpoint-every"])
    config = config_from_args(args)
    assert config.allow_change == ("steps", "checkpoint_every")
    assert runtime_argv(config)[-2:] == ["--allow-change", "steps,checkpoint-every"]
    with pytest.raises(QSyncError, match="^--allow-change takes steps, checkpoint-every, "
                       "keep-checkpoints, on-nonfinite, deterministic, warmup-steps; a change "
                       "of 'seed' makes another run: start a fresh --run-dir$"):
        config_from_args(runtime_parser().parse_args(["--plan", "p", "--allow-change", "seed"]))


def _without_ranks(state: dict) -> dict:
    return {key: value for key, value in state.items() if key != "ranks"}


def _with_a_ragged_model(state: dict) -> dict:
    return {**state, "model": {name: value[:1] if value.dim() else value
                               for name, value in state["model"].items()}}


@pytest.mark.parametrize("craft, found", [(_without_ranks, "KeyError: 'ranks'"),
                                          (_with_a_ragged_model, "RuntimeError: ")])
def test_a_verified_checkpoint_with_odd_entries_is_one_line(tmp_path, single_rank_group,
                                                            craft, found):
    """Made by hand with a valid sha256: its entries are checked as they are put back."""
    plan, run = one_rank_plan(tmp_path), tmp_path / "run"
    train(TrainConfig(str(plan), str(run), steps=2, checkpoint_every=2))
    saved = load_checkpoint(checkpoint_path(run, 2))
    manifest = {key: value for key, value in saved.manifest.items()
                if key not in ("format", "sha256")}
    save_checkpoint(checkpoint_path(run, 2), craft(saved.state), manifest)
    with pytest.raises(QSyncError, match=f"checkpoint-00000002.safetensors verifies but does not "
                       f"hold this run's state \\({found}") as err:
        train(TrainConfig(str(plan), str(run), steps=4, checkpoint_every=2, resume=True,
                          allow_change=("steps",)))
    assert "\n" not in str(err.value) and str(err.value).endswith("start a fresh --run-dir")


def test_a_fresh_run_removes_an_earlier_runs_outputs(tmp_path, single_rank_group, capsys):
    """Else a later ``--resume`` would continue, or find complete, the earlier run, and a
    fresh run that fails would leave the earlier run's summary and weights as its own."""
    plan, run = one_rank_plan(tmp_path), tmp_path / "run"
    train(TrainConfig(str(plan), str(run), steps=4, checkpoint_every=2))
    capsys.readouterr()
    with pytest.raises(QSyncError, match="non-finite"):  # diverges at once
        train(TrainConfig(str(plan), str(run), steps=3, checkpoint_every=0, lr=1e30))
    assert ("removed the earlier run's checkpoints (steps 2, 4), summary.json and "
            "final.safetensors; --resume continues a run instead") in capsys.readouterr().err
    assert sorted(path.name for path in run.iterdir()) == [".qsync.lock", "metrics.jsonl", "ranks"]
    resumed = train(TrainConfig(str(plan), str(run), steps=4, checkpoint_every=2, resume=True))
    assert resumed is not None and resumed["resumed_from"] == 0
