"""Property: a plan or cluster with any one field mutated is rejected in one line, or it
checks out against the model and simulates, and then passes ``qsync-lab run``'s checks
before launch (:func:`~qsync_lab.runtime.launch.check_run`: the zoo model built from the
plan's name and kwargs and traced) or is refused there in one line (issue #23: "each file
is either rejected in one line or simulates and runs").

Accepted plans are not trained here: they are plans for the two ranks of ``local-hybrid``
(rank ids, per-rank batches and the T4's precisions are what the mutator varies), the
runtime's in-process path (``tests/runtime/test_trainer_local.py``) has one rank, and a
torchrun launch per plan would take seconds each."""

import copy
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qsync_lab.cluster import cluster_from_definition, load_cluster
from qsync_lab.errors import QSyncError
from qsync_lab.plan import Plan
from qsync_lab.runtime.launch import check_run
from qsync_lab.runtime.options import TrainConfig
from qsync_lab.simulate import simulate

MUTATION_SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                             suppress_health_check=[HealthCheck.too_slow])

#: values a hostile or careless editor puts in place of a field
HOSTILE = st.one_of(
    st.sampled_from([None, True, False, 0, -16, 16.9, 1e308, -1e308, math.nan, math.inf,
                     -math.inf, 2**63, 2**64, 10**30, -1, 1, 4096, 4097, 2**20 + 1, "",
                     " ", "../../etc/passwd", "os:system", "fp16", "int8", "T4", "cpu",
                     "global_qsgd:8", "re:(", "digits_cnn", [], {}, [0], {"x": 1}]),
    st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=2),
)
MUTATIONS = ("replace", "delete", "add_key", "nest", "nest_deep")
MLP_KWARGS = {"in_features": 8, "hidden": 16, "num_classes": 4}


@pytest.fixture(scope="module")
def mlp_graph():
    """The zoo's digits_mlp(**MLP_KWARGS), traced as ``qsync-lab run`` traces it."""
    from qsync_lab.runtime.launch import _model_graph

    return _model_graph("digits_mlp", MLP_KWARGS)


@pytest.fixture(scope="module")
def plan_document(mlp_graph):
    """A valid plan document touching every field (sha256 left out, so that mutations of
    the cluster definition reach its checks instead of failing the hash)."""
    plan = Plan.build(mlp_graph, load_cluster("local-hybrid"),
                      {"T4": {"fc1": "int8", "fc3": {"forward": "fp16", "backward": "fp32"}}},
                      strategy="test", optimizer="adamw",
                      compression={"fc1.weight": "cgx:4", "re:.*bias": None,
                                   "_default": "global_qsgd:8"})
    document = plan.for_model("digits_mlp", MLP_KWARGS).to_dict()
    del document["_data"]["cluster"]["sha256"]
    return document


@pytest.fixture(scope="module")
def cluster_definition():
    """Every key a cluster may have: two nodes, an inline link, per-group batch sizes."""
    return {"name": "mutant", "description": "two nodes", "batch_size": 8,
            "inter_node_link": {"bandwidth_GBps": 12.5, "latency_us": 20},
            "node": [{"name": "a", "intra_node_link": "nvlink2",
                      "devices": [{"kind": "V100-SXM2-32GB", "count": 2, "batch_size": 16}]},
                     {"name": "b", "intra_node_link": "pcie3_x16",
                      "devices": [{"kind": "T4", "count": 1, "emulate_on": "cpu"}]}]}


def _paths(value, prefix=()):
    """Every path (tuple of keys and indices) into ``value``, the root excluded."""
    children = (value.items() if isinstance(value, dict)
                else enumerate(value) if isinstance(value, list) else ())
    for key, child in children:
        yield prefix + (key,)
        yield from _paths(child, prefix + (key,))


def _mutated(document, path, mutation, value, key):
    """A copy of ``document`` with one ``mutation`` at ``path``."""
    document = copy.deepcopy(document)
    *parents, last = path
    parent = document
    for step in parents:
        parent = parent[step]
    if mutation == "replace":
        parent[last] = value
    elif mutation == "delete":
        del parent[last]
    elif mutation == "add_key":
        target = parent[last] if isinstance(parent[last], dict) else parent
        target[key] = value
    elif mutation == "nest":
        parent[last] = [parent[last]] if isinstance(value, list) else {key: parent[last]}
    else:  # nest_deep: past the depth limit
        nested = parent[last]
        for _ in range(40):
            nested = [nested]
        parent[last] = nested
    return document


def _mutation(document):
    paths = list(_paths(document))
    return st.tuples(st.sampled_from(paths), st.sampled_from(MUTATIONS), HOSTILE,
                     st.text(min_size=1, max_size=8))


def _one_line(err: QSyncError) -> str:
    message = str(err)
    assert message and "\n" not in message, message
    return message


@MUTATION_SETTINGS
@given(data=st.data())
def test_a_mutated_plan_is_rejected_in_one_line_or_simulates(data, plan_document, mlp_graph,
                                                             tmp_path_factory):
    path, mutation, value, key = data.draw(_mutation(plan_document))
    document = _mutated(plan_document, path, mutation, value, key)
    graph = mlp_graph
    try:
        plan = Plan.from_dict(document, origin="plan")
        plan.validate(graph, plan.cluster)
    except QSyncError as err:
        _one_line(err)
        plan = None
    file = tmp_path_factory.mktemp("plan") / "plan.json"
    file.write_text(json.dumps(document))  # NaN and Infinity as JavaScript writes them
    try:
        loaded = Plan.load(file, graph=graph)
    except QSyncError as err:
        _one_line(err)
        loaded = None
    assert (loaded is None) == (plan is None), "Plan.load and Plan.from_dict disagree"
    if plan is not None:
        assert loaded == plan
        assert 0 < plan.world_size <= 4096
        assert all(0 < b <= 2**20 and type(b) is int for b in plan.batch_sizes)
        assert [r.rank for r in plan.ranks] == list(range(plan.world_size))
        sim = simulate(graph, plan)
        assert sim.iteration_us > 0 and math.isfinite(sim.iteration_us)
        _checked_before_launch(file)


def _checked_before_launch(file) -> None:
    """``qsync-lab run``'s checks pass, or refuse the file in one line."""
    try:
        check_run(TrainConfig(plan=str(file), run_dir=str(file.parent / "run")))
    except QSyncError as err:
        _one_line(err)


@MUTATION_SETTINGS
@given(data=st.data())
def test_a_mutated_cluster_is_rejected_in_one_line_or_simulates(data, cluster_definition,
                                                                graph):
    path, mutation, value, key = data.draw(_mutation(cluster_definition))
    definition = _mutated(cluster_definition, path, mutation, value, key)
    try:
        cluster = cluster_from_definition(definition, origin="cluster")
    except QSyncError as err:
        _one_line(err)
        return
    assert 0 < cluster.world_size <= 4096
    assert all(0 < r.batch_size <= 2**20 for r in cluster.ranks)
    assert cluster.fingerprint() == cluster_from_definition(cluster.definition).fingerprint()
    assert str(cluster).startswith(cluster.name)
    plan = Plan.build(graph, cluster, {})
    sim = simulate(graph, plan)
    assert sim.iteration_us > 0 and math.isfinite(sim.iteration_us)


def test_the_unmutated_documents_are_accepted(plan_document, cluster_definition, mlp_graph,
                                              tmp_path):
    """The properties above are not vacuous: the documents they mutate are valid, and the
    plan passes the checks before launch."""
    plan = Plan.from_dict(plan_document)
    plan.validate(mlp_graph, plan.cluster)
    assert plan.model_name == "digits_mlp" and plan.world_size == 2
    (tmp_path / "plan.json").write_text(json.dumps(plan_document))
    assert check_run(TrainConfig(plan=str(tmp_path / "plan.json"),
                                 run_dir=str(tmp_path / "run"))) == plan
    assert cluster_from_definition(cluster_definition).world_size == 3
