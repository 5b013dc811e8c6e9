import shlex

import pytest

from qsync_lab.cluster import load_cluster
from qsync_lab.plan import Plan, RankPlan
from qsync_lab.widgets import cluster_commands, reshape_cluster


def test_export_writes_a_plan_that_loads_and_shows_the_clusters_command(tuner, study, tmp_path):
    tuner.controls.strategy.value = "uniform-low"
    tuner.export_folder.value = "plans/uniform"
    tuner.export_button.click()
    path = tmp_path / "plans" / "uniform" / "plan.json"
    assert Plan.load(path, graph=study.graph) == tuner.result.plan
    assert not list(path.parent.glob(".*.tmp"))
    status = tuner.export_status.value
    assert f"wrote <code>{path}</code>" in status  # absolute: findable wherever the root is
    command, here = (shlex.split(part.split("</pre>")[0]) for part in status.split("<pre>")[1:])
    assert command[0] == "torchrun" and command[-2:] == ["--plan", str(path)]
    assert {"--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
            "--rdzv-endpoint=HOST:29400"} <= set(command)
    assert command[command.index("-m") + 1] == "qsync_lab.runtime"
    # the tuner's cluster is local-hybrid, whose ranks this machine emulates
    assert here == ["qsync-lab", "run", "--plan", str(path)]


def test_a_plan_for_gpus_this_machine_lacks_exports_with_emulate(monkeypatch, tmp_path):
    from qsync_lab.runtime import machine
    from qsync_lab.widgets.export import local_command

    monkeypatch.setattr(machine, "cuda_here", lambda: False)
    cluster = load_cluster("v100-t4-small")
    plan = Plan("abc", cluster.definition, tuple(RankPlan(r.rank, r.device, 32)
                                                 for r in cluster.ranks), {})
    assert local_command(tmp_path / "p.json", plan).endswith("--emulate")


def test_the_exported_plan_records_the_constraints_the_summary_shows(tuner, study, tmp_path):
    """The tuner's memory slider is the plan's recorded budget: in its summary, in the file."""
    tuner.controls.memory_gib["T4"].value = 0.5
    tuner.export_folder.value = "plans/tight"
    tuner.export_button.click()
    loaded = Plan.load(tmp_path / "plans" / "tight" / "plan.json", graph=study.graph)
    assert loaded.constraints.memory_gib["T4"] == 0.5
    assert loaded.constraints == tuner.result.plan.constraints
    assert "T4 0.5 GiB; throughput: the fastest kind at fp32 sets the pace" in \
        tuner.summary.value


@pytest.mark.parametrize("folder", ["../x", "a/../../x", "a/../b", "/tmp/elsewhere"])
def test_export_refuses_a_folder_outside_its_root(tuner, tmp_path, folder):
    tuner.export_folder.value = folder
    tuner.export_button.click()
    assert "is not inside" in tuner.export_status.value
    assert "<pre>" not in tuner.export_status.value
    assert not ((tmp_path / folder).resolve() / "plan.json").exists()


def test_nodes_of_different_sizes_get_one_command_each():
    cluster = reshape_cluster(load_cluster("qsync-paper"), counts={"T4": 3})
    plan = Plan("abc", cluster.definition,
                tuple(RankPlan(r.rank, r.device, r.batch_size) for r in cluster.ranks), {})
    commands = cluster_commands("/abs/plan.json", plan, host="10.0.0.1")
    assert [c.splitlines()[0] for c in commands] == ["# v100-0", "# v100-1", "# t4-0"]
    assert [next(a for a in c.split() if a.startswith("--nproc")) for c in commands] \
        == ["--nproc-per-node=8", "--nproc-per-node=8", "--nproc-per-node=3"]
    assert all("--nnodes=3" in c and "--rdzv-endpoint=10.0.0.1:29400" in c for c in commands)
