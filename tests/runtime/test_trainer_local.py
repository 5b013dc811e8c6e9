"""The training runtime in this process on one gloo rank: logs, checkpoints, resume, errors."""

import json
import statistics

import pytest
import torch

from qsync_lab.errors import QSyncError
from qsync_lab.models import get_model
from qsync_lab.quant import apply_plan_, restore_rounding_counters, rounding_counters
from qsync_lab.runtime.checkpoint import load_checkpoint
from qsync_lab.runtime.metrics import read_metrics
from qsync_lab.runtime.tasks import Task
from qsync_lab.runtime.trainer import TrainConfig, train
from tests.runtime.conftest import cluster_file, write_plan

INT8 = {"cpu": {"fc1": "int8", "conv2": "int8"}}
TINY_BERT = {"vocab_size": 256, "seq_len": 16}


def _one_rank_plan(tmp_path, precisions=None, batch=32, **plan_args):
    cluster = cluster_file(tmp_path, [f'{{ kind = "cpu", count = 1, batch_size = {batch} }}'])
    return write_plan(tmp_path / "plan.json", cluster, precisions or {}, **plan_args)


def test_training_logs_every_step_checkpoints_and_learns(tmp_path, single_rank_group):
    plan = _one_rank_plan(tmp_path, INT8)
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
    assert load_checkpoint(tmp_path / "run" / "checkpoint.pt")["step"] == 30
    # the final weights are a plain state_dict: a model without any plan loads them
    get_model("digits_cnn").load_state_dict(torch.load(tmp_path / "run" / "final.pt")["model"])


def test_resume_continues_bit_exactly(tmp_path, single_rank_group):
    # BERT-mini: dropout draws from the RNG, so its state must come back with the weights
    plan = _one_rank_plan(tmp_path, {"cpu": {"bert.encoder.layer.0.intermediate.dense": "int8"}},
                          model="bert_mini", task="tokens", **TINY_BERT)
    whole, split = tmp_path / "whole", tmp_path / "split"
    adamw = {"optimizer": "adamw", "lr": 1e-3}  # its two moments must come back too
    train(TrainConfig(str(plan), str(whole), steps=12, checkpoint_every=6, **adamw))
    train(TrainConfig(str(plan), str(split), steps=6, checkpoint_every=6, **adamw))
    halfway = load_checkpoint(split / "checkpoint.pt")
    assert set(halfway["optimizer"]["state"][0]) >= {"exp_avg", "exp_avg_sq"}
    halfway = halfway["model"]
    summary = train(TrainConfig(str(plan), str(split), steps=12, checkpoint_every=6,
                                resume=True, **adamw))
    assert summary["resumed_from"] == 6
    assert [r["step"] for r in read_metrics(split / "metrics.jsonl")] == list(range(12))
    a, b = (torch.load(d / "final.pt")["model"] for d in (whole, split))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], halfway[k]) for k in a)  # it trained after resuming


def test_resume_with_compression_continues_bit_exactly(tmp_path, single_rank_group):
    # stochastic codes seeded by the call count, and error-feedback residuals
    plan = _one_rank_plan(tmp_path, compression={
        "conv2.weight": "cgx:4,error_feedback=true", "_default": "global_qsgd:8"})
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(TrainConfig(str(plan), str(whole), steps=8, checkpoint_every=4))
    train(TrainConfig(str(plan), str(split), steps=4, checkpoint_every=4))
    saved = load_checkpoint(split / "checkpoint.pt")["compression"][0]
    assert saved["calls"] > 0 and set(saved["residuals"]) == {"conv2.weight"}
    train(TrainConfig(str(plan), str(split), steps=8, checkpoint_every=4, resume=True))
    records = read_metrics(split / "metrics.jsonl")
    assert records[-1]["compression"]["cgx"]["elements"] > 0
    a, b = (torch.load(d / "final.pt")["model"] for d in (whole, split))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rounding_counters_round_trip():
    plan = {"fc1": {"forward": "int8", "rounding": "stochastic"}}
    model, twin = get_model("digits_mlp"), get_model("digits_mlp")
    for m in (model, twin):
        apply_plan_(m, plan)
    model(torch.randn(4, 64))
    model(torch.randn(4, 64))
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
    plan = _one_rank_plan(tmp_path)
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
    with pytest.raises(QSyncError, match="T4 cannot run bf16|T4 does not support bf16"):
        train(TrainConfig(str(plan), str(tmp_path / "run"), steps=1))


def test_device_kind_override_must_be_in_the_plan(tmp_path, single_rank_group, monkeypatch):
    plan = _one_rank_plan(tmp_path)
    monkeypatch.setenv("QSYNC_DEVICE_KIND", "A100")
    with pytest.raises(QSyncError, match="QSYNC_DEVICE_KIND='A100' is not a device kind"):
        train(TrainConfig(str(plan), str(tmp_path / "run"), steps=1))


def test_resume_under_another_plan_is_refused(tmp_path, single_rank_group):
    plan = _one_rank_plan(tmp_path)
    train(TrainConfig(str(plan), str(tmp_path / "run"), steps=2, checkpoint_every=1))
    other = write_plan(tmp_path / "other.json", cluster_file(
        tmp_path, ['{ kind = "cpu", count = 1, batch_size = 32 }'], "c2"), {"cpu": {"fc1": "bf16"}})
    with pytest.raises(QSyncError, match="written under another plan"):
        train(TrainConfig(str(other), str(tmp_path / "run"), steps=3, resume=True))


@pytest.mark.parametrize("field, value, message", [
    ("steps", 0, "--steps must be a positive integer"),
    ("steps", True, "--steps must be a positive integer"),
    ("checkpoint_every", -1, "--checkpoint-every must be a non-negative integer"),
    ("lr", float("nan"), "--lr must be a finite non-negative number"),
    ("optimizer", "lion", "unknown optimizer 'lion'")])
def test_bad_config_values(field, value, message):
    with pytest.raises(QSyncError, match=message):
        TrainConfig("plan.json", **{field: value})


def test_predicted_tensor_peak_counts_the_optimizer_of_the_run(tmp_path, single_rank_group):
    """For SGD, SGD with momentum and AdamW the run's measured peak tensor memory (model build
    and first steps) is within 10 % of the prediction, and the measured differences between
    them are the optimizers' fp32 state, as the memory model counts it (+1 and +2 copies of
    the parameters)."""
    plan = _one_rank_plan(tmp_path, model="bert_mini", task="tokens", vocab_size=2000,
                          seq_len=32)
    measured = {}
    for optimizer in ("sgd", "sgd_momentum", "adamw"):
        summary = train(TrainConfig(str(plan), str(tmp_path / optimizer), steps=3,
                                    checkpoint_every=0, optimizer=optimizer, lr=1e-3))
        assert summary["optimizer"] == optimizer
        assert abs(summary["tensor_peak_error_pct"]) < 10, (optimizer, summary)
        measured[optimizer] = summary["measured_tensor_peak_mib"]
    params_mib = 4 * sum(p.numel() for p in get_model("bert_mini", vocab_size=2000,
                                                      seq_len=32).parameters()) / 2**20
    assert measured["sgd_momentum"] - measured["sgd"] == pytest.approx(params_mib, rel=0.05)
    assert measured["adamw"] - measured["sgd"] == pytest.approx(2 * params_mib, rel=0.05)


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
