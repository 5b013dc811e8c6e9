"""The training runtime in this process on one gloo rank: logs, checkpoints, resume, errors."""

import dataclasses
import json
import math
import statistics

import pytest
import torch

from qsync_lab.errors import QSyncError
from qsync_lab.models import get_model
from qsync_lab.quant import apply_plan_, restore_rounding_counters, rounding_counters
from qsync_lab.runtime import rank_context
from qsync_lab.runtime.__main__ import main
from qsync_lab.runtime.checkpoint import checkpoint_path, load_checkpoint
from qsync_lab.runtime.metrics import read_metrics, summary_line
from qsync_lab.runtime.sampler import UnevenBatchSampler
from qsync_lab.runtime.tasks import Task, load_task
from qsync_lab.runtime.trainer import TrainConfig, train
from tests.runtime.conftest import (SHIPPED_PROFILE, cluster_file, final_parameters,
                                   one_rank_plan, write_plan)

INT8 = {"cpu": {"fc1": "int8", "conv2": "int8"}}
TINY_BERT = {"vocab_size": 256, "seq_len": 16}


def test_training_logs_every_step_checkpoints_and_learns(tmp_path, single_rank_group):
    plan = one_rank_plan(tmp_path, INT8)
    summary = train(TrainConfig(str(plan), str(tmp_path / "run"), steps=40, checkpoint_every=15))
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(40))
    losses = [r["loss"] for r in records]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses
    assert summary["test_accuracy"] > 0.8
    assert summary["ranks"][0]["applied_plan"]["fc1"] == "int8/fp16 nearest tensor"
    assert summary["predicted_step_ms"] > 0 and summary["measured_tensor_peak_mib"] > 0
    # the step-time median leaves out the first fifth of the steps (8 of 40) by default
    timed = [r["step_ms"][0] for r in records[8:]]
    assert summary["ranks"][0]["median_step_ms"] == pytest.approx(statistics.median(timed),
                                                                  abs=1e-3)
    assert load_checkpoint(checkpoint_path(tmp_path / "run", 30)).step == 30
    # the final weights are a plain state_dict: a model without any plan loads them
    get_model("digits_cnn").load_state_dict(final_parameters(tmp_path / "run"))


def test_resume_continues_bit_exactly(tmp_path, single_rank_group):
    # BERT-mini: dropout draws from the RNG, so its state must come back with the weights
    plan = one_rank_plan(tmp_path, {"cpu": {"bert.encoder.layer.0.intermediate.dense": "int8"}},
                          model="bert_mini", task="tokens", **TINY_BERT)
    whole, split = tmp_path / "whole", tmp_path / "split"
    adamw = {"optimizer": "adamw", "lr": 1e-3,  # its two moments must come back too
             "profiles": (SHIPPED_PROFILE,)}
    train(TrainConfig(str(plan), str(whole), steps=12, checkpoint_every=6, **adamw))
    train(TrainConfig(str(plan), str(split), steps=6, checkpoint_every=6, **adamw))
    halfway = load_checkpoint(checkpoint_path(split, 6)).state
    assert set(halfway["optimizer"]["state"][0]) >= {"exp_avg", "exp_avg_sq"}
    halfway = halfway["model"]
    summary = train(TrainConfig(str(plan), str(split), steps=12, checkpoint_every=6,
                                resume=True, allow_change=("steps",), **adamw))
    assert summary["resumed_from"] == 6
    assert [r["step"] for r in read_metrics(split / "metrics.jsonl")] == list(range(12))
    a, b = (final_parameters(d) for d in (whole, split))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], halfway[k]) for k in a)  # it trained after resuming


def test_resume_with_compression_continues_bit_exactly(tmp_path, single_rank_group):
    # stochastic codes seeded by the call count, and error-feedback residuals
    plan = one_rank_plan(tmp_path, compression={
        "conv2.weight": "cgx:4,error_feedback=true", "_default": "global_qsgd:8"})
    whole, split = tmp_path / "whole", tmp_path / "split"
    shipped = {"profiles": (SHIPPED_PROFILE,)}
    train(TrainConfig(str(plan), str(whole), steps=8, checkpoint_every=4, **shipped))
    train(TrainConfig(str(plan), str(split), steps=4, checkpoint_every=4, **shipped))
    saved = load_checkpoint(checkpoint_path(split, 4)).state["ranks"][0]["compression"]
    assert saved["calls"] > 0 and set(saved["residuals"]) == {"conv2.weight"}
    train(TrainConfig(str(plan), str(split), steps=8, checkpoint_every=4, resume=True,
                      allow_change=("steps",), **shipped))
    records = read_metrics(split / "metrics.jsonl")
    assert records[-1]["compression"]["cgx"]["elements"] > 0
    a, b = (final_parameters(d) for d in (whole, split))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rounding_counters_round_trip():
    plan = {"fc1": {"forward": "int8", "rounding": "stochastic"}}
    model, twin = get_model("digits_mlp"), get_model("digits_mlp")
    for m in (model, twin):
        apply_plan_(m, plan)
    model(torch.randn(4, 40))
    model(torch.randn(4, 40))
    assert rounding_counters(model) == {"fc1": 2}
    restore_rounding_counters(twin, rounding_counters(model))
    assert twin.fc1.next_seeds(2) == model.fc1.next_seeds(2)
    with pytest.raises(QSyncError, match="'fc9'"):
        restore_rounding_counters(twin, {"fc9": 1})


def test_a_user_task_plugs_in(tmp_path, single_rank_group):
    x = torch.randn(256, 6, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()

    def build():
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    task = Task("sign", "", build, (x[:192],), y[:192], (x[192:],), y[192:])
    from qsync_lab.cluster import load_cluster
    from qsync_lab.graph import trace_graph
    from qsync_lab.plan import Plan

    cluster = cluster_file(tmp_path, ['{ kind = "cpu", count = 1, batch_size = 32 }'])
    graph = trace_graph(build(), (x[:4],), target=y[:4], loss_fn=task.loss_fn())
    Plan.build(graph, load_cluster(cluster), {"cpu": {"0": "int8"}}).save(tmp_path / "p.json")
    summary = train(TrainConfig(str(tmp_path / "p.json"), str(tmp_path / "run"), steps=60,
                                lr=0.1), task=task)
    assert summary["model"] == "user" and summary["test_accuracy"] > 0.9


def test_a_user_model_is_profiled_once_and_predicted_from_its_profile(
        tmp_path, single_rank_group, monkeypatch):
    from qsync_lab.cluster import load_cluster
    from qsync_lab.costs import load_cost_model, read_profile
    from qsync_lab.graph import trace_graph
    from qsync_lab.plan import Plan
    from qsync_lab.resources import data_file
    from qsync_lab.runtime.prediction import predict_plan

    monkeypatch.setenv("QSYNC_LAB_CACHE", str(tmp_path / "cache"))
    x = torch.randn(128, 24, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()

    def build():
        return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(),
                                   torch.nn.Linear(40, 2))

    task = Task("sign", "", build, (x[:96],), y[:96], (x[96:],), y[96:])
    cluster = cluster_file(tmp_path, ['{ kind = "cpu", count = 1, batch_size = 16 }'])
    graph = trace_graph(build(), (x[:16],), target=y[:16], loss_fn=task.loss_fn())
    plan = Plan.build(graph, load_cluster(cluster), {"cpu": {"0": "bf16"}})
    plan.save(tmp_path / "p.json")
    summary = train(TrainConfig(str(tmp_path / "p.json"), str(tmp_path / "run"), steps=8),
                    task=task)
    (cached,) = (tmp_path / "cache" / "profiles").glob("*.csv")
    rows = read_profile(cached).frame
    assert set(rows["op"]) >= {"0", "1", "2"} and set(rows["batch_size"]) == {16}
    assert set(rows["plan_precision"]) == {"fp32", "bf16"}
    costs = load_cost_model(cached, data_file("profiles", "cpu.csv"))
    predicted = predict_plan(plan, graph, costs, optimizer=summary["optimizer"])
    assert summary["predicted_step_ms"] == pytest.approx(predicted.iteration_us / 1e3)
    written = cached.stat().st_mtime_ns
    train(TrainConfig(str(tmp_path / "p.json"), str(tmp_path / "run2"), steps=2), task=task)
    assert cached.stat().st_mtime_ns == written  # read back, not measured again


@pytest.mark.parametrize("change, message", [
    ({"model": "digits_mlp"}, "another model"),
    ({"data": "imagenet"}, "unknown task 'imagenet'"),
    ({"data": "tokens"}, "task 'tokens' trains bert_mini, not digits_cnn"),
])
def test_wrong_model_or_data_is_one_line(tmp_path, single_rank_group, change, message):
    plan = one_rank_plan(tmp_path)
    with pytest.raises(QSyncError, match=message) as err:
        train(TrainConfig(str(plan), str(tmp_path / "run"), steps=1, **change))
    assert "\n" not in str(err.value)


def test_world_size_must_match_the_plan(tmp_path, single_rank_group):
    plan = write_plan(tmp_path / "plan.json", "local-cpu", {})
    with pytest.raises(QSyncError, match="has 2 ranks but torchrun started 1; use "
                       "--nproc-per-node=2"):
        train(TrainConfig(str(plan), str(tmp_path / "run"), steps=1))


def test_a_precision_the_device_cannot_run_is_refused(tmp_path, single_rank_group):
    cluster = cluster_file(tmp_path, ['{ kind = "T4", count = 1, emulate_on = "cpu" }'])
    plan = write_plan(tmp_path / "plan.json", cluster, {"T4": {"fc1": "fp16"}})
    document = json.loads(plan.read_text())
    document["_data"]["precisions"]["T4"]["fc1"] = "bf16"   # hand-edited
    plan.write_text(json.dumps(document))
    with pytest.raises(QSyncError, match="T4 does not support bf16"):
        train(TrainConfig(str(plan), str(tmp_path / "run"), steps=1))


def test_device_kind_override_must_be_in_the_plan(tmp_path, single_rank_group, monkeypatch):
    plan = one_rank_plan(tmp_path)
    monkeypatch.setenv("QSYNC_DEVICE_KIND", "A100")
    with pytest.raises(QSyncError, match="QSYNC_DEVICE_KIND='A100' is not a device kind"):
        train(TrainConfig(str(plan), str(tmp_path / "run"), steps=1))


def _bad_profile(run):
    profile = run.parent / "bad.csv"
    profile.write_text("device,op,kind,shape_key,precision,phase,batch_size,numel,flops,bytes,"
                       "time_us,repeats\ncpu,fc,linear,,fp32,forward,32,0,1,1,inf,20\n")
    return {"profiles": (str(profile),)}


def _symlinked(name):
    def make(run):
        elsewhere = run.parent / "elsewhere"
        elsewhere.mkdir()
        (run / name).symlink_to(elsewhere / name if name != "ranks" else elsewhere)
        return {}
    return make


@pytest.mark.parametrize("fault, message", [
    (_bad_profile, "time_us must be a number >= 0 and finite, got 'inf'"),
    (_symlinked("summary.json"), "refusing to write through the symlink .*/run/summary.json"),
    (_symlinked("ranks"), "refusing to write through the symlink .*/run/ranks;")],
    ids=["bad-profile", "symlinked-summary", "symlinked-ranks-folder"])
def test_a_bad_profile_or_a_symlinked_output_stops_before_the_first_step(
        tmp_path, single_rank_group, fault, message):
    """As torchrun started directly finds them: refused before training, not after."""
    run = tmp_path / "run"
    run.mkdir()
    options = fault(run)
    with pytest.raises(QSyncError, match=message) as err:
        train(TrainConfig(str(one_rank_plan(tmp_path)), str(run), steps=2, **options))
    assert "\n" not in str(err.value)
    assert not (run / "metrics.jsonl").exists()
    assert not (tmp_path / "elsewhere").exists() or not any((tmp_path / "elsewhere").iterdir())


def test_resume_under_another_plan_is_refused(tmp_path, single_rank_group):
    plan = one_rank_plan(tmp_path)
    train(TrainConfig(str(plan), str(tmp_path / "run"), steps=2, checkpoint_every=1))
    other = write_plan(tmp_path / "other.json", cluster_file(
        tmp_path, ['{ kind = "cpu", count = 1, batch_size = 32 }'], "c2"), {"cpu": {"fc1": "bf16"}})
    with pytest.raises(QSyncError, match=r"differs from its checkpoint in: .*plan "
                       r"[0-9a-f]{16}\.\.\. -> [0-9a-f]{16}\.\.\.; start a fresh --run-dir") as err:
        train(TrainConfig(str(other), str(tmp_path / "run"), steps=3, resume=True))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("field, value, message", [
    ("steps", 0, "--steps must be a positive integer"),
    ("steps", True, "--steps must be a positive integer"),
    ("checkpoint_every", -1, "--checkpoint-every must be a non-negative integer"),
    ("keep_checkpoints", 0, "--keep-checkpoints must be a positive integer"),
    ("on_nonfinite", "ignore", "--on-nonfinite must be one of stop, skip"),
    ("lr", float("nan"), "--lr must be a finite non-negative number"),
    ("optimizer", "lion", "unknown optimizer 'lion'"),
    ("allow_change", ("lr",), "a change of 'lr' makes another run: start a fresh --run-dir"),
    ("allow_change", ("steps",), "--allow-change applies with --resume")])
def test_bad_config_values(field, value, message):
    with pytest.raises(QSyncError, match=message):
        TrainConfig("plan.json", **{field: value})


class _DictModel(torch.nn.Module):
    """Called as ``model(**batch)``, returning a dict (Hugging Face style)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(20, 8), torch.nn.Linear(8, 2)

    def forward(self, input_ids, weights):
        pooled = (self.embed(input_ids) * weights.unsqueeze(-1)).mean(dim=1)
        return {"logits": self.head(pooled)}


class _DictLoss(torch.nn.Module):
    def forward(self, out, target):
        return torch.nn.functional.cross_entropy(out["logits"], target)


def test_a_dict_batch_model_trains_and_is_profiled(tmp_path, single_rank_group, monkeypatch):
    from qsync_lab.cluster import load_cluster
    from qsync_lab.costs import read_profile
    from qsync_lab.graph import trace_graph
    from qsync_lab.plan import Plan

    monkeypatch.setenv("QSYNC_LAB_CACHE", str(tmp_path / "cache"))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (96, 5), generator=generator)
    batch = {"input_ids": ids, "weights": torch.ones(96, 5)}
    y = (ids[:, 0] < 10).long()
    task = Task("dict", "", _DictModel, batch, y, batch, y, loss_fn=_DictLoss)
    cluster = cluster_file(tmp_path, ['{ kind = "cpu", count = 1, batch_size = 16 }'])
    inputs, target = task.example(16)
    graph = trace_graph(_DictModel(), inputs, target=target, loss_fn=_DictLoss())
    Plan.build(graph, load_cluster(cluster), {"cpu": {"head": "bf16"}}).save(tmp_path / "p.json")
    summary = train(TrainConfig(str(tmp_path / "p.json"), str(tmp_path / "run"), steps=6),
                    task=task)
    assert summary["test_accuracy"] is None and summary["test_loss"] > 0  # no class scores
    assert summary["ranks"][0]["applied_plan"]["head"].startswith("bf16")
    (cached,) = (tmp_path / "cache" / "profiles").glob("*.csv")
    assert {"embed", "head"} <= set(read_profile(cached).frame["op"])


class _SqrtProbe(torch.nn.Module):
    """Finite outputs; a sample whose first feature is 0 gives ``z`` a NaN gradient (the
    derivative of sqrt at 0, times 0)."""

    def __init__(self):
        super().__init__()
        self.fc, self.z = torch.nn.Linear(6, 2), torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.fc(x) + 0.0 * torch.sqrt(self.z * x[:, :1].abs())


NONFINITE_STEP, PROBE_SAMPLES = 3, 192


def _nan_loss(x, index):
    x[index, 1] = math.nan


def _nan_gradient(x, index):
    x[index, 0] = 0.0


def _probe_task(tmp_path, poison):
    """The probe task, with ``poison`` applied to the first sample of step NONFINITE_STEP
    (and a NaN in the test inputs); its plan; the poisoned sample's index."""
    x = torch.randn(PROBE_SAMPLES, 6, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    x_test = x[:64].clone()
    x_test[0, 1] = math.nan
    index = int(UnevenBatchSampler(PROBE_SAMPLES, (32,), 0).indices(NONFINITE_STEP, 0)[0])
    poison(x, index)
    task = Task("probe", "", _SqrtProbe, (x,), y, (x_test,), y[:64])
    from qsync_lab.cluster import load_cluster
    from qsync_lab.graph import trace_graph
    from qsync_lab.plan import Plan

    cluster = cluster_file(tmp_path, ['{ kind = "cpu", count = 1, batch_size = 32 }'])
    graph = trace_graph(_SqrtProbe(), (x[:4],), target=y[:4], loss_fn=task.loss_fn())
    Plan.build(graph, load_cluster(cluster), {}).save(tmp_path / "p.json")
    return task, tmp_path / "p.json", index


@pytest.mark.parametrize("poison, cause", [(_nan_loss, "loss on rank 0"),
                                           (_nan_gradient, "gradient of z")])
def test_a_nonfinite_value_stops_the_run_naming_the_step(tmp_path, single_rank_group, poison,
                                                         cause):
    task, plan, _ = _probe_task(tmp_path, poison)
    run = tmp_path / "run"
    with pytest.raises(QSyncError, match=f"^non-finite {cause} at step {NONFINITE_STEP}; every "
                       "rank stopped") as err:
        train(TrainConfig(str(plan), str(run), steps=8, checkpoint_every=2,
                          profiles=(SHIPPED_PROFILE,)), task=task)
    assert "\n" not in str(err.value)
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(NONFINITE_STEP + 1))
    assert records[-1]["nonfinite"] == cause and "nonfinite" not in records[-2]
    assert (records[-1]["loss"] is None) == (poison is _nan_loss)
    assert list(run.glob("checkpoint-*")) == [checkpoint_path(run, 2)]  # none after it


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_skip_mode_skips_and_counts_and_the_json_files_stay_strict(tmp_path, single_rank_group):
    task, plan, index = _probe_task(tmp_path, _nan_loss)
    run, steps = tmp_path / "run", 8
    summary = train(TrainConfig(str(plan), str(run), steps=steps, on_nonfinite="skip"),
                    task=task)
    sampler = UnevenBatchSampler(PROBE_SAMPLES, (32,), 0)
    poisoned = [step for step in range(steps) if index in sampler.indices(step, 0).tolist()]
    assert poisoned[0] == NONFINITE_STEP and summary["nonfinite_steps_skipped"] == len(poisoned)
    assert f"{steps} steps ({len(poisoned)} non-finite step" in summary_line(summary)
    written = _strict_json((run / "summary.json").read_text())
    assert written["test_loss"] is None and written["nonfinite_steps_skipped"] == len(poisoned)
    records = [_strict_json(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["loss"] is None] == poisoned
    final = load_checkpoint(run / "final.safetensors").state["model"]
    assert all(bool(torch.isfinite(value).all()) for value in final.values())


def _nan_inputs(*args, **kwargs):
    """A bundled task whose training inputs are all NaN."""
    task = load_task(*args, **kwargs)
    return dataclasses.replace(task, train_inputs=(task.train_inputs[0] * math.nan,))


def test_the_command_exits_2_with_one_line_on_a_nonfinite_loss(tmp_path, single_rank_group,
                                                               monkeypatch, capsys):
    monkeypatch.setattr(rank_context, "load_task", _nan_inputs)
    plan = one_rank_plan(tmp_path)
    assert main(["--plan", str(plan), "--run-dir", str(tmp_path / "run"), "--steps", "3",
                 "--threads", str(torch.get_num_threads())]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == ["qsync_lab.runtime: error: non-finite loss on rank 0 at step 0; every rank "
                      "stopped (lower --lr or check the data; --on-nonfinite skip skips such "
                      "steps)"]


def test_a_compressed_run_stops_in_one_line_and_refuses_skip_mode(tmp_path, single_rank_group,
                                                                   monkeypatch):
    plan = one_rank_plan(tmp_path, compression={"_default": "global_qsgd:8"})
    with pytest.raises(QSyncError, match="--on-nonfinite skip does not work with gradient "
                       "compression"):
        train(TrainConfig(str(plan), str(tmp_path / "run"), steps=2, on_nonfinite="skip"))
    monkeypatch.setattr(rank_context, "load_task", _nan_inputs)
    with pytest.raises(QSyncError, match="^step 0: a gradient of a global_qsgd bucket holds "
                       "NaN or Inf") as err:  # the hook stops every rank; DDP passes only text
        train(TrainConfig(str(plan), str(tmp_path / "run"), steps=2))
    assert "\n" not in str(err.value)
