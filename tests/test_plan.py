import json

import pytest
import torch
import torch.nn as nn

from qsync_lab.cluster import load_cluster
from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph
from qsync_lab.plan import PLAN_TYPE, SCHEMA_VERSION, Plan


@pytest.fixture(scope="module")
def graph():
    torch.manual_seed(0)
    return trace_graph(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                       torch.randn(2, 8))


@pytest.fixture(scope="module")
def cluster():
    return load_cluster("v100-t4-small")


@pytest.fixture
def plan(graph, cluster):
    return Plan.build(graph, cluster, {"T4": {"0": "int8", "2": "fp16"}}, strategy="test",
                      gradient_compression={"0.weight": {"method": "qsgd", "bits": 8}})


def test_round_trip(plan, graph, cluster, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path, graph=graph, cluster=cluster)
    assert loaded == plan
    assert loaded.to_dict() == plan.to_dict()
    document = json.loads(path.read_text())
    assert document["_type"] == PLAN_TYPE and document["_version"] == SCHEMA_VERSION
    assert document["_data"]["ranks"][2] == {"rank": 2, "device": "T4", "batch_size": 32}
    assert loaded.low_precision_ops() == {"V100-SXM2-32GB": 0, "T4": 2}


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


def test_unknown_fqn(plan, graph, cluster, tmp_path):
    path = _edited(plan, tmp_path,
                   lambda d: d["_data"]["precisions"]["T4"].update({"9": "fp16"}))
    _one_line_error(path, "'9'", graph=graph, cluster=cluster)


def test_precision_the_device_cannot_run(plan, graph, cluster, tmp_path):
    path = _edited(plan, tmp_path, lambda d: d["_data"]["precisions"]["V100-SXM2-32GB"].update(
        {"0": "int8"}))
    _one_line_error(path, "does not support int8", graph=graph, cluster=cluster)
    _one_line_error(path, "cannot run int8", cluster=cluster)


def test_world_size_mismatch(plan, graph, tmp_path):
    plan.save(tmp_path / "plan.json")
    _one_line_error(tmp_path / "plan.json", "for 4 ranks, cluster 'local-hybrid' has 2",
                    graph=graph, cluster=load_cluster("local-hybrid"))


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update({"_type": "torchao.Config"}), "not a qsync_lab plan"),
    (lambda d: d.update({"_version": SCHEMA_VERSION + 1}), "newer than this"),
    (lambda d: d["_data"].pop("ranks"), "lacks _data.ranks"),
    (lambda d: d["_data"]["precisions"]["T4"].update({"0": "int3"}), "unknown precision"),
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
