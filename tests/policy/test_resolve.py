"""Plan validation (one-line errors) and QSync's precision policy for unplanned ops."""

import pytest
import torch
import torch.nn as nn
from tests.simulate.conftest import FAST, SLOW

from qsync_lab.costs import CostModel, op_work
from qsync_lab.devices import load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph
from qsync_lab.simulate import resolve_precisions, simulate


@pytest.mark.parametrize("plan, message", [
    ({SLOW: {"fc9": "fp16"}}, "unknown op 'fc9'"),
    ({FAST: {"0": "int8"}}, "V100-SXM2-32GB does not support int8"),
    ({SLOW: {"1": "fp16"}}, "op '1' is of kind activation, whose precision follows its inputs"),
    ({"A100-SXM4-80GB": {"0": "fp16"}}, "which the cluster does not have"),
    ({"B300": {"0": "fp16"}}, "unknown device 'B300'"),
    ({SLOW: {"0": "fp12"}}, "unknown precision 'fp12'"),
])
def test_bad_plans_raise_one_line_errors(graph, make_cluster, plan, message):
    with pytest.raises(QSyncError, match=message) as info:
        simulate(graph, plan, make_cluster([FAST, SLOW]), CostModel())
    assert "\n" not in str(info.value)


def test_int8_is_refused_for_norms_and_embeddings():
    model = nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    work = op_work(trace_graph(model, torch.randint(0, 10, (2, 3))))
    t4 = load_catalog().device("T4")
    for fqn in ("0", "1"):
        with pytest.raises(QSyncError, match="needs a floating-point precision"):
            resolve_precisions(work, {fqn: "int8"}, t4)
    assert [str(p) for p in resolve_precisions(work, {"0": "fp16", "1": "fp16", "2": "int8"},
                                               t4).precision] == ["fp16", "fp16", "int8"]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.act, self.drop, self.soft = nn.GELU(), nn.Dropout(0.1), nn.Softmax(-1)

    def forward(self, x):
        h = self.drop(self.act(self.fc1(x)))
        return self.soft(self.fc2(x) + h)


def test_unplanned_ops_follow_qsync_policy():
    work = op_work(trace_graph(_Block(), torch.randn(2, 8)))
    t4 = load_catalog().device("T4")
    assignment = resolve_precisions(work, {"fc1": "fp16", "fc2": "fp16"}, t4)
    precision = dict(zip(work.names, map(str, assignment.precision)))
    # GELU, add and softmax stay fp32 (deny list); dropout follows its fp32 producer
    assert precision == {"fc1": "fp16", "act": "fp32", "drop": "fp32", "fc2": "fp16",
                         "add": "fp32", "soft": "fp32"}
    tf32 = resolve_precisions(work, {"fc1": "tf32"}, load_catalog().device("A100-SXM4-80GB"))
    assert str(tf32.output[0]) == "fp32"  # tf32 computes, but stores fp32: no casts
