"""Tests for cluster loading (qsync_lab.cluster, data/clusters/*.toml)."""

import re
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from qsync_lab.cluster import cluster_from_definition, list_clusters, load_cluster
from qsync_lab.devices import load_catalog
from qsync_lab.errors import QSyncError

SHIPPED = ["local-cpu", "local-hybrid", "one-gpu-hybrid", "qsync-paper", "v100-t4-small"]

USER_CLUSTER = """
name = "mine"
batch_size = 8
inter_node_link = { name = "roce", bandwidth_GBps = 12.5, latency_us = 5 }

[[node]]
name = "a"
intra_node_link = "pcie4_x16"
devices = [{ kind = "A10" }, { kind = "L4", count = 2, batch_size = 4 }]

[[node]]
name = "b"
intra_node_link = { bandwidth_GBps = 64, latency_us = 1 }
devices = [{ kind = "Gizmo", count = 3 }]
"""
GIZMO = """
[device.Gizmo]
vendor = "Acme"
kind = "gpu"
compute_capability = "7.0"
memory_gib = 12
memory_bandwidth_GBps = 500
peak_tflops = { fp32 = 10, fp16 = 80 }
source = "test fixture"
"""
# Two nodes, so each field of the schema has a place to go wrong.
VALID = """
name = "bad"
batch_size = 32
inter_node_link = "eth_100g"

[[node]]
name = "n0"
intra_node_link = "nvlink2"
devices = [{ kind = "V100-SXM2-32GB", count = 2 }]

[[node]]
name = "n1"
intra_node_link = "pcie3_x16"
devices = [{ kind = "T4", count = 2 }]
"""


def write(tmp_path: Path, text: str, name: str = "cluster.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_list_clusters():
    assert list_clusters() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_cluster_loads(name):
    cluster = load_cluster(name)
    assert cluster.name == name
    assert cluster.description
    assert [r.rank for r in cluster.ranks] == list(range(cluster.world_size))
    assert cluster.source.endswith(f"{name}.toml")
    assert str(cluster).startswith(f"{name}: {cluster.world_size} ranks")


def test_qsync_paper():
    cluster = load_cluster("qsync-paper")
    assert cluster.world_size == 32
    assert cluster.device_kinds == ("V100-SXM2-32GB", "T4")
    assert [r.device for r in cluster.ranks] == ["V100-SXM2-32GB"] * 16 + ["T4"] * 16
    assert cluster.node_names == ("v100-0", "v100-1", "t4-0", "t4-1")
    assert [(r.node, r.local_rank) for r in cluster.ranks[7:10]] == [(0, 7), (1, 0), (1, 1)]
    assert cluster.global_batch_size == 32 * 32
    assert cluster.device_of(15).name == "V100-SXM2-32GB"
    assert cluster.device_of(16).name == "T4"
    assert cluster.link_between(0, 7).name == "nvlink2"
    assert cluster.link_between(16, 23).name == "pcie3_x16"
    assert cluster.link_between(0, 8).name == "eth_100g"
    assert cluster.link_between(15, 16).name == "eth_100g"
    assert "assumption" in cluster.description
    assert all(r.emulate_on is None for r in cluster.ranks)


def test_local_hybrid_emulates_two_kinds_on_the_cpu():
    cluster = load_cluster("local-hybrid")
    assert cluster.world_size == 2
    assert cluster.device_kinds == ("V100-SXM2-32GB", "T4")
    assert [r.emulate_on for r in cluster.ranks] == ["cpu", "cpu"]
    assert cluster.inter_node_link is None
    assert cluster.link_between(0, 1).name == "loopback"
    assert cluster.device_of(1).supports("int8") and not cluster.device_of(0).supports("int8")


def test_local_cpu_and_small_hybrid():
    local = load_cluster("local-cpu")
    assert [r.device for r in local.ranks] == ["cpu", "cpu"]
    assert local.device_of(0).emulated
    small = load_cluster("v100-t4-small")
    assert [r.device for r in small.ranks] == ["V100-SXM2-32GB"] * 2 + ["T4"] * 2
    assert [r.local_rank for r in small.ranks] == [0, 1, 2, 3]
    assert small.link_between(1, 2).name == "pcie3_x16"


def test_ranks_frame():
    frame = load_cluster("qsync-paper").ranks_frame()
    assert list(frame.columns) == [
        "rank", "node", "node_name", "local_rank", "device", "batch_size", "emulate_on", "gpu",
        "sms"
    ]
    assert len(frame) == 32
    assert frame.loc[17].tolist() == [17, 2, "t4-0", 1, "T4", 32, None, None, None]


def test_summary_one_row_per_device_kind():
    summary = load_cluster("qsync-paper").summary()
    assert list(summary.index) == ["V100-SXM2-32GB", "T4"]
    assert {
        "ranks", "nodes", "batch_size_per_rank", "batch_size_total", "memory_gib", "fp32_tflops",
        "low_precision", "low_precision_tflops", "fp32_tflops_total", "precisions",
    } <= set(summary.columns)
    v100, t4 = summary.loc["V100-SXM2-32GB"], summary.loc["T4"]
    assert (v100["ranks"], v100["nodes"], v100["batch_size_per_rank"]) == (16, 2, 32)
    assert (v100["low_precision"], v100["low_precision_tflops"]) == ("fp16", 125.0)
    assert (t4["low_precision"], t4["low_precision_tflops"]) == ("int8", 130.0)
    assert t4["memory_gib"] == 16.0
    assert t4["fp32_tflops_total"] == pytest.approx(16 * 8.1)
    assert t4["batch_share"] == 0.5
    assert t4["precisions"] == "fp32, fp16, int8"
    assert t4["intra_node_links"] == "pcie3_x16"


def test_low_precision_column_skips_fp32(tmp_path):
    # the emulating cpu has equal peaks everywhere: the first precision after fp32 wins
    assert load_cluster("local-cpu").summary().loc["cpu", "low_precision"] == "tf32"
    fp32_only = GIZMO.replace('"7.0"', '"6.1"').replace(", fp16 = 80", "")
    catalog = load_catalog(write(tmp_path, fp32_only, "devices.toml"))
    text = VALID.replace('"V100-SXM2-32GB"', '"Gizmo"')
    gizmo = load_cluster(write(tmp_path, text), catalog=catalog).summary().loc["Gizmo"]
    assert pd.isna(gizmo["low_precision"])
    assert pd.isna(gizmo["low_precision_tflops"])
    assert gizmo["precisions"] == "fp32"


def test_user_cluster_with_own_devices_and_inline_links(tmp_path):
    catalog = load_catalog(write(tmp_path, GIZMO, "devices.toml"))
    cluster = load_cluster(write(tmp_path, USER_CLUSTER), catalog=catalog)
    assert cluster.source == str(tmp_path / "cluster.toml")
    assert [r.device for r in cluster.ranks] == ["A10", "L4", "L4", "Gizmo", "Gizmo", "Gizmo"]
    assert [r.batch_size for r in cluster.ranks] == [8, 4, 4, 8, 8, 8]
    assert cluster.global_batch_size == 40
    assert cluster.description == ""
    assert cluster.link_between(0, 3).name == "roce"
    assert cluster.link_between(0, 3).bandwidth_Bps == pytest.approx(12.5e9)
    assert cluster.link_between(3, 5).name == "inline"
    assert cluster.link_between(3, 5).bandwidth_Bps == pytest.approx(64e9)
    assert cluster.device_of(5).peak_flops_for("fp16") == pytest.approx(80e12)
    summary = cluster.summary()
    assert summary.loc["L4", "batch_size_per_rank"] == 4
    assert summary.loc["Gizmo", "batch_size_total"] == 24


def test_mixed_batch_sizes_within_a_kind(tmp_path):
    text = VALID.replace('count = 2 }', 'count = 1 }, { kind = "T4", batch_size = 16 }', 1)
    cluster = load_cluster(write(tmp_path, text))
    t4 = cluster.summary().loc["T4"]
    assert pd.isna(t4["batch_size_per_rank"])
    assert t4["batch_size_total"] == 16 + 2 * 32
    assert "mixed batch sizes" in str(cluster)


def test_path_and_name_forms(tmp_path):
    path = write(tmp_path, VALID)
    assert load_cluster(str(path)).world_size == load_cluster(path).world_size == 4
    expected = r"^unknown cluster 'qsync'; choose one of: local-cpu, .*path"
    with pytest.raises(QSyncError, match=expected):
        load_cluster("qsync")


def test_rank_out_of_range():
    expected = r"rank 32 is out of range for cluster 'qsync-paper'; use 0\.\.31"
    with pytest.raises(QSyncError, match=expected):
        load_cluster("qsync-paper").device_of(32)
    with pytest.raises(QSyncError, match="rank -1 is out of range"):
        load_cluster("qsync-paper").link_between(0, -1)


def _break(old: str, new: str, count: int = 1):
    """A cluster text: VALID with its ``count``-th occurrence of ``old`` replaced by ``new``."""
    parts = VALID.split(old)
    assert len(parts) > count, old
    return old.join(parts[:count]) + new + old.join(parts[count:])


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        pytest.param(
            "name = \n",
            "",
            "invalid TOML: ",
            id="syntax",
        ),
        pytest.param(
            _break('name = "bad"\n', ""),
            "name",
            "missing; expected a non-empty string",
            id="no-name",
        ),
        pytest.param(
            'name = "x"\nbatch_size = 1\n',
            "node",
            "missing; expected a non-empty array of tables",
            id="no-nodes",
        ),
        pytest.param(
            'name = "x"\nnode = []\n',
            "node",
            "expected a non-empty array of tables, got []",
            id="empty-nodes",
        ),
        pytest.param(
            _break('"T4"', '"P100"'),
            "node[1].devices[0].kind",
            "unknown device 'P100'; choose one of: T4",
            id="kind",
        ),
        pytest.param(
            _break("count = 2", "count = 0", 2),
            "node[1].devices[0].count",
            "expected a positive integer, got 0",
            id="count-0",
        ),
        pytest.param(
            _break("count = 2", "count = -1"),
            "node[0].devices[0].count",
            "got -1",
            id="count-neg",
        ),
        pytest.param(
            _break("batch_size = 32", 'batch_size = "32"'),
            "batch_size",
            "expected a positive integer, got '32'",
            id="batch-str",
        ),
        pytest.param(
            _break("batch_size = 32", "batch_size = 1.5"),
            "batch_size",
            "got 1.5",
            id="batch-float",
        ),
        pytest.param(
            _break("count = 2", "count = 2, batch_size = 0"),
            "node[0].devices[0].batch_size",
            "got 0",
            id="group-batch",
        ),
        pytest.param(
            _break("batch_size = 32\n", ""),
            "node[0].devices[0].batch_size",
            "missing; set a positive integer here or a top-level batch_size",
            id="no-batch",
        ),
        pytest.param(
            _break('"nvlink2"', '"nvlink9"'),
            "node[0].intra_node_link",
            "unknown link 'nvlink9'",
            id="link",
        ),
        pytest.param(
            _break('"eth_100g"', "{ bandwidth_GBps = 1 }"),
            "inter_node_link.latency_us",
            "missing",
            id="inline-link",
        ),
        pytest.param(
            _break('"eth_100g"', "3"),
            "inter_node_link",
            "expected a link name from links.toml or an inline table",
            id="link-type",
        ),
        pytest.param(
            _break('inter_node_link = "eth_100g"\n', ""),
            "inter_node_link",
            "missing; expected a link name",
            id="no-inter-link",
        ),
        pytest.param(
            _break("count = 2", 'count = 2, emulate_on = "gpu"'),
            "node[0].devices[0].emulate_on",
            "expected \"cpu\", got 'gpu'",
            id="emulate-on",
        ),
        pytest.param(
            _break('"n1"', '"n0"'),
            "node[1].name",
            "duplicate node name 'n0' (also node[0])",
            id="dup-node",
        ),
        pytest.param(
            _break("count = 2", "count = 2, kinds = 1"),
            "node[0].devices[0].kinds",
            "unknown key; expected one of: batch_size, count, emulate_on, gpu, kind, sms",
            id="group-key",
        ),
        pytest.param(
            _break("[[node]]", "[[nodes]]"),
            "nodes",
            "unknown key",
            id="top-key",
        ),
        pytest.param(
            _break("devices = [", "devices = 1 #"),
            "node[0].devices",
            "expected a non-empty array of tables, got 1",
            id="devices-type",
        ),
    ],
)
def test_malformed_cluster_is_one_line_naming_file_and_key(tmp_path, text, key, reason):
    path = write(tmp_path, text)
    with pytest.raises(QSyncError) as err:
        load_cluster(path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: {key}: " if key else f"{path}: ")
    assert reason in message


def test_valid_fixture_loads(tmp_path):
    """The base of the malformed cases above is itself valid."""
    cluster = load_cluster(write(tmp_path, VALID))
    assert [r.device for r in cluster.ranks] == ["V100-SXM2-32GB"] * 2 + ["T4"] * 2


def test_missing_cluster_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(QSyncError, match=rf"^{re.escape(str(missing))}: no such file"):
        load_cluster(missing)


def _cluster_text(devices: str) -> str:
    return ('name = "split"\nbatch_size = 8\n[[node]]\nname = "n0"\n'
            f'intra_node_link = "loopback"\ndevices = [{devices}]\n')


def test_a_rank_may_run_on_a_share_of_a_gpus_sms(tmp_path):
    cluster = load_cluster("one-gpu-hybrid")
    fast, slow = (cluster.catalog.device(r.device) for r in cluster.ranks)
    h100 = cluster.catalog.device("H100-SXM5-80GB")
    assert [(r.device, r.gpu, r.sms) for r in cluster.ranks] == [
        ("H100-SXM5-80GB/116sm", 0, 116), ("H100-SXM5-80GB/16sm", 0, 16)]
    assert slow.peak_flops_for("bf16") == pytest.approx(h100.peak_flops_for("bf16") * 16 / 132)
    assert fast.memory_bandwidth_Bps == pytest.approx(h100.memory_bandwidth_Bps * 116 / 132)
    assert slow.precisions == h100.precisions and not slow.emulated
    again = cluster_from_definition(cluster.definition)  # a plan carries it
    assert again.device_kinds == cluster.device_kinds


@pytest.mark.parametrize("devices, message", [
    ('{ kind = "H100-SXM5-80GB", count = 2, sms = 100 }',
     "GPU 0 of this node would give 200 SMs to its ranks but a H100-SXM5-80GB has 132"),
    ('{ kind = "H100-SXM5-80GB", sms = 0 }', "sms"),
    ('{ kind = "H100-SXM5-80GB", sms = 200 }', "over the limit of 132"),
    ('{ kind = "cpu", sms = 4 }', "cpu has no sm_count"),
    ('{ kind = "T4", gpu = 1 }', "gpu applies to a group that runs on a share of a GPU"),
])
def test_impossible_partitions_are_refused_in_one_line(tmp_path, devices, message):
    path = tmp_path / "split.toml"
    path.write_text(_cluster_text(devices))
    with pytest.raises(QSyncError, match=re.escape(message)):
        load_cluster(path)


def test_partitions_of_two_gpus_are_counted_apart(tmp_path):
    path = tmp_path / "split.toml"
    path.write_text(_cluster_text('{ kind = "H100-SXM5-80GB", sms = 100 }, '
                                  '{ kind = "H100-SXM5-80GB", sms = 100, gpu = 1 }'))
    assert [r.gpu for r in load_cluster(path).ranks] == [0, 1]
