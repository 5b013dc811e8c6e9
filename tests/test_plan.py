"""Plan: the version-2 document, its round trip, migration of version 1, bad files."""

import json
import os
import stat

import pytest
import torch
import torch.nn as nn

from qsync_lab.cluster import load_cluster
from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph
from qsync_lab.plan import PLAN_TYPE, SCHEMA_VERSION, Plan, PlanMigrationWarning
from qsync_lab.policy import OpPrecision


@pytest.fixture(scope="module")
def cluster():
    return load_cluster("v100-t4-small")


@pytest.fixture
def plan(graph, cluster):
    return Plan.build(graph, cluster, {"T4": {"0": "int8", "2": "fp16"}}, strategy="test",
                      optimizer="adamw", compression={"0.weight": "cgx:4", "_default": "qsgd:8"})


def test_round_trip(plan, graph, cluster, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path, graph=graph, cluster=cluster)
    assert loaded == plan
    assert loaded.to_dict() == plan.to_dict()
    document = json.loads(path.read_text())
    assert document["_type"] == PLAN_TYPE and document["_version"] == SCHEMA_VERSION
    assert document["_data"]["ranks"][2] == {"rank": 2, "device": "T4", "batch_size": 32}
    assert document["_data"]["precisions"]["T4"]["0"] == {
        "forward": "int8", "backward": "fp16", "rounding": "nearest", "granularity": "tensor"}
    assert document["_data"]["optimizer"] == "adamw"
    assert document["_data"]["compression"] == {"0.weight": {"method": "cgx", "bits": 4},
                                                "_default": {"method": "qsgd"}}
    assert str(loaded.compression_settings) == "cgx:4 for 0.weight, qsgd:8"
    assert loaded.low_precision_ops() == {"V100-SXM2-32GB": 0, "T4": 2}


def test_the_full_operator_config_survives_the_round_trip(graph, cluster, tmp_path):
    cfg = {"forward": "int8", "backward": "fp32", "rounding": "stochastic",
           "granularity": "channel"}
    plan = Plan.build(graph, cluster, {"T4": {"0": cfg}})
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").precisions["T4"]["0"] == OpPrecision.parse(cfg)


def test_the_plan_carries_its_cluster_not_a_path(plan, graph, tmp_path):
    plan.save(tmp_path / "plan.json")
    text = (tmp_path / "plan.json").read_text()
    assert "/data/clusters" not in text and str(tmp_path) not in text
    loaded = Plan.load(tmp_path / "plan.json", graph=graph)  # no cluster needed
    assert loaded.cluster.name == "v100-t4-small" and loaded.cluster.world_size == 4
    assert json.loads(text)["_data"]["cluster"]["sha256"] == loaded.cluster.fingerprint()


def test_an_edited_cluster_definition_fails_its_hash(plan, tmp_path):
    path = _edited(plan, tmp_path, lambda d: d["_data"]["cluster"]["definition"].update(
        {"batch_size": 64}))
    _one_line_error(path, "does not match its sha256")


def test_files_get_the_umask_mode(plan, tmp_path):
    mask = os.umask(0o022)
    try:
        plan.save(tmp_path / "plan.json")
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "plan.json").stat().st_mode) == 0o644


def _v1_document(plan, cluster_source, cluster_name="v100-t4-small"):
    """The version-1 form of ``plan``, as qsync_lab 0.1 wrote it."""
    return {"_type": PLAN_TYPE, "_version": 1, "_data": {
        "model_fingerprint": plan.model_fingerprint,
        "cluster": {"name": cluster_name, "source": str(cluster_source)},
        "ranks": [{"rank": r.rank, "device": r.device, "batch_size": r.batch_size}
                  for r in plan.ranks],
        "precisions": {kind: {fqn: str(cfg.forward) for fqn, cfg in ops.items()}
                       for kind, ops in plan.precisions.items()},
        "gradient_compression": {}, "strategy": "qsync",
        "model": {"name": "digits_mlp", "kwargs": {}}}}


def test_a_version_1_plan_is_migrated_with_a_note(plan, graph, cluster, tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_v1_document(plan, cluster.source)))
    with pytest.warns(PlanMigrationWarning, match="version-1 plan: read as version 2"):
        old = Plan.load(path, graph=graph)
    assert old.precisions == plan.precisions and old.ranks == plan.ranks
    assert old.optimizer == "sgd_momentum" and old.model_name == "digits_mlp"
    assert old.cluster.fingerprint() == cluster.fingerprint()
    old.save(path)
    assert json.loads(path.read_text())["_version"] == SCHEMA_VERSION


def test_a_version_1_plan_whose_cluster_file_is_gone_uses_the_shipped_one(plan, tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_v1_document(plan, "/gone/v100-t4-small.toml")))
    with pytest.warns(PlanMigrationWarning):
        assert Plan.load(path).cluster.name == "v100-t4-small"
    path.write_text(json.dumps(_v1_document(plan, "/gone/mine.toml", "mine")))
    _one_line_error(path, "cluster file /gone/mine.toml is gone and 'mine' is not a shipped")


def test_save_is_atomic_and_leaves_no_temp_files(plan, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("old")
    plan.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    assert json.loads(path.read_text())["_type"] == PLAN_TYPE


def _one_line_error(path, match, **kwargs):
    with pytest.raises(QSyncError, match=match) as err:
        Plan.load(path, **kwargs)
    assert "\n" not in str(err.value)


def test_load_against_another_model(plan, cluster, tmp_path):
    other = trace_graph(nn.Sequential(nn.Linear(8, 4)), torch.randn(2, 8))
    plan.save(tmp_path / "plan.json")
    _one_line_error(tmp_path / "plan.json", "another model", graph=other, cluster=cluster)


def _edited(plan, tmp_path, edit):
    document = plan.to_dict()
    edit(document)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(document))
    return path


def test_compression_of_a_parameter_the_model_lacks(plan, graph, cluster, tmp_path):
    path = _edited(plan, tmp_path, lambda d: d["_data"]["compression"].update(
        {"fc9.weight": {"method": "fp16"}}))
    _one_line_error(path, "compresses parameter 'fc9.weight'", graph=graph, cluster=cluster)


def test_unknown_fqn(plan, graph, cluster, tmp_path):
    path = _edited(plan, tmp_path,
                   lambda d: d["_data"]["precisions"]["T4"].update({"9": "fp16"}))
    _one_line_error(path, "'9'", graph=graph, cluster=cluster)


def test_precision_the_device_cannot_run(plan, graph, cluster, tmp_path):
    path = _edited(plan, tmp_path, lambda d: d["_data"]["precisions"]["V100-SXM2-32GB"].update(
        {"0": "int8"}))
    match = "op '0': V100-SXM2-32GB does not support int8"
    _one_line_error(path, match, graph=graph, cluster=cluster)
    _one_line_error(path, match)


def test_a_forward_the_device_has_no_kernel_for_is_refused_without_a_graph(graph, tmp_path):
    cluster = tmp_path / "h100.toml"
    cluster.write_text('name = "h100"\nbatch_size = 8\n\n[[node]]\nname = "n0"\n'
                       'intra_node_link = "loopback"\n'
                       'devices = [{ kind = "H100-SXM5-80GB", count = 1 }]\n')
    plan = Plan.build(graph, load_cluster(cluster), {"H100-SXM5-80GB": {"0": "fp8_e4m3"}})
    path = _edited(plan, tmp_path, lambda d: d["_data"]["precisions"]["H100-SXM5-80GB"].update(
        {"0": "fp8_e5m2"}))
    _one_line_error(path, "op '0': H100-SXM5-80GB has no fp8_e5m2 x fp8_e5m2 GEMM")


def test_world_size_mismatch(plan, graph, tmp_path):
    plan.save(tmp_path / "plan.json")
    _one_line_error(tmp_path / "plan.json", "for 4 ranks, cluster 'local-hybrid' has 2",
                    graph=graph, cluster=load_cluster("local-hybrid"))


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update({"_type": "torchao.Config"}), "not a qsync_lab plan"),
    (lambda d: d.update({"_version": SCHEMA_VERSION + 1}), "newer than this"),
    (lambda d: d["_data"].pop("ranks"), "lacks _data.ranks"),
    (lambda d: d["_data"]["precisions"]["T4"].update({"0": "int3"}), "unknown precision"),
    (lambda d: d["_data"].update({"optimizer": "lamb"}), "unknown optimizer 'lamb'"),
    (lambda d: d["_data"]["ranks"][0].update({"batch_size": 16.5}), "expected an integer"),
    (lambda d: d.update({"_version": True}), "invalid _version"),
    (lambda d: d["_data"].update({"compression": {"_default": "zip"}}),
     "unknown compression method 'zip'"),
    (lambda d: d["_data"].update({"compression": {"_default": {"method": "cgx", "bits": 9}}}),
     "compression cgx: bits must be 1..8, got 9"),
])
def test_malformed_documents(plan, tmp_path, edit, match):
    _one_line_error(_edited(plan, tmp_path, edit), match)


def test_unreadable_file(tmp_path):
    (tmp_path / "plan.json").write_text("{not json")
    _one_line_error(tmp_path / "plan.json", "cannot read plan")


def test_apply_to_sets_the_planned_batch_sizes(graph, cluster):
    from qsync_lab.allocate.baselines import with_batch_sizes

    plan = Plan.build(graph, with_batch_sizes(cluster, (40, 40, 24, 24)), {})
    assert [r.batch_size for r in plan.apply_to(cluster).ranks] == [40, 40, 24, 24]


def _constrained(graph, cluster, **constraints):
    from qsync_lab.constraints import Constraints

    return Plan.build(graph, cluster, {"T4": {"0": "fp16"}}, strategy="qsync",
                      constraints=Constraints(**constraints))


def test_the_constraints_a_plan_was_made_under_round_trip(graph, cluster, tmp_path):
    """Recorded with the catalog's kind names, written as ``_data.constraints``, read back
    equal; the one line that shows them names the budget given and the device's memory."""
    plan = _constrained(graph, cluster, memory_gib={"t4": 1}, throughput_samples_per_s=500.0)
    plan.save(tmp_path / "plan.json")
    document = json.loads((tmp_path / "plan.json").read_text())
    assert document["_data"]["constraints"] == {"memory_gib": {"T4": 1.0},
                                                "throughput_samples_per_s": 500.0}
    loaded = Plan.load(tmp_path / "plan.json", graph=graph)
    assert loaded == plan and loaded.constraints == plan.constraints
    assert dict(loaded.constraints.memory_gib) == {"T4": 1.0}
    assert loaded.made_under() == (
        "qsync (optimizer sgd_momentum, compression none) under memory V100-SXM2-32GB 32 GiB "
        "(device memory), T4 1 GiB; throughput: at least 500 samples/s")


@pytest.mark.parametrize("edit", [lambda d: d["_data"].pop("constraints"),
                                  lambda d: d["_data"].update({"constraints": None})])
def test_a_plan_without_constraints_still_loads_and_says_so(graph, cluster, tmp_path, edit):
    """A file written before plans recorded their constraints has no such key."""
    path = _edited(_constrained(graph, cluster, memory_gib={"T4": 1}), tmp_path, edit)
    loaded = Plan.load(path, graph=graph)
    assert loaded.constraints is None
    assert "constraints not recorded" in loaded.made_under()
    assert json.loads(loaded.to_json())["_data"]["constraints"] is None


@pytest.mark.parametrize("constraints, match", [
    ({"memory_gib": {"T4": -1}}, "memory budget for T4 must be a positive number of GiB"),
    ({"memory_gib": {"A100-SXM4-40GB": 8}}, "memory budget for A100-SXM4-40GB, which cluster"),
    ({"memory_gib": {"T4": True}}, "memory budget for T4 must be a positive number"),
    ({"throughput_samples_per_s": "fast"}, "throughput constraint must be a positive number"),
    ({"memory_gib": {}, "pace": 1}, "unknown key 'pace'"),
    ([1], "_data.constraints must be a table"),
])
def test_malformed_constraints_are_one_line(graph, cluster, tmp_path, constraints, match):
    path = _edited(_constrained(graph, cluster), tmp_path,
                   lambda d: d["_data"].update({"constraints": constraints}))
    _one_line_error(path, match)


@pytest.fixture(scope="module")
def digits_study():
    from qsync_lab.study import Study

    return Study("digits_mlp", cluster="local-hybrid", progress=False)


@pytest.mark.parametrize("strategy", ["qsync", "uniform-low", "dynamic-batching", "joint",
                                      "fp32"])
def test_every_strategy_records_the_constraints_it_planned_under(digits_study, strategy):
    plan = digits_study.plan(memory_limit={"T4": 2}, throughput_target=1.0, strategy=strategy)
    assert plan.strategy == strategy
    assert dict(plan.constraints.memory_gib) == {"T4": 2.0}
    assert plan.constraints.throughput_samples_per_s == 1.0


def test_a_device_kind_the_cluster_lacks_is_refused_when_built(graph):
    partitioned = load_cluster("one-gpu-hybrid")  # kinds H100-SXM5-80GB/116sm and /16sm
    with pytest.raises(QSyncError, match="device kind 'H100-SXM5-80GB', which cluster "
                                         "'one-gpu-hybrid' does not have"):
        Plan.build(graph, partitioned, {"H100-SXM5-80GB": {"0": "bf16"}})
