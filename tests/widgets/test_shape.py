import pytest

from qsync_lab.cluster import load_cluster
from qsync_lab.errors import QSyncError
from qsync_lab.widgets import kind_batch_sizes, kind_counts, reshape_cluster

V100 = "V100-SXM2-32GB"


def test_counts_fill_a_kinds_groups_in_order_and_its_last_takes_the_rest():
    cluster = reshape_cluster(load_cluster("qsync-paper"), counts={V100: 20, "T4": 3})
    assert cluster.node_names == ("v100-0", "v100-1", "t4-0")
    per_node = [sum(r.node == n for r in cluster.ranks) for n in range(3)]
    assert per_node == [8, 12, 3]
    assert kind_counts(cluster) == {V100: 20, "T4": 3}
    assert cluster.link_between(8, 19).name == "nvlink2"   # one node
    assert cluster.link_between(0, 20).name == "eth_100g"


def test_a_count_of_zero_drops_the_kind_and_its_nodes():
    cluster = reshape_cluster(load_cluster("qsync-paper"), counts={"T4": 0})
    assert cluster.device_kinds == (V100,)
    assert cluster.node_names == ("v100-0", "v100-1")


def test_batch_sizes_per_kind_and_nothing_changed_is_the_same_cluster():
    hybrid = load_cluster("local-hybrid")
    assert reshape_cluster(hybrid, counts={"T4": 1}, batch_sizes={"T4": 16}) is hybrid
    bigger = reshape_cluster(hybrid, batch_sizes={"T4": 64})
    assert [r.batch_size for r in bigger.ranks] == [16, 64]
    assert kind_batch_sizes(bigger) == {V100: 16, "T4": 64}
    assert bigger.name == "local-hybrid-custom"
    assert bigger.fingerprint() != hybrid.fingerprint()


@pytest.mark.parametrize("counts, batch_sizes, message", [
    ({"A100": 1}, {}, "no device kind 'A100'"),
    ({"T4": -1}, {}, "T4: -1"),
    ({}, {"T4": 0}, "T4: 0"),
    ({V100: 0, "T4": 0}, {}, "at least one rank"),
])
def test_impossible_shapes_are_one_line_errors(counts, batch_sizes, message):
    with pytest.raises(QSyncError, match=message):
        reshape_cluster(load_cluster("local-hybrid"), counts=counts, batch_sizes=batch_sizes)
