"""Plan validation (one-line errors), the follow rules for unplanned ops, the storage rules."""

import pytest
import torch
import torch.nn as nn

from qsync_lab.costs import op_work
from qsync_lab.devices import load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph
from qsync_lab.policy import resolve_precisions


def test_norms_refuse_int8_and_embeddings_refuse_tf32():
    model = nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    work = op_work(trace_graph(model, torch.randint(0, 10, (2, 3))))
    t4, a100 = load_catalog().device("T4"), load_catalog().device("A100-SXM4-80GB")
    with pytest.raises(QSyncError, match="op '1': layer_norm ops cannot run int8"):
        resolve_precisions(work, {"1": "int8"}, t4)
    with pytest.raises(QSyncError, match="op '0': embedding ops cannot run tf32"):
        resolve_precisions(work, {"0": "tf32"}, a100)
    assignment = resolve_precisions(work, {"0": "int8", "1": "fp16", "2": "int8"}, t4)
    assert [str(p) for p in assignment.precision] == ["int8", "fp16", "int8"]
    assert [str(p) for p in assignment.output] == ["fp32", "fp16", "fp32"]


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


def test_fp8_ops_write_fp32_and_compute_their_backward_in_e5m2():
    work = op_work(trace_graph(_Block(), torch.randn(2, 8)))
    h100 = load_catalog().device("H100-SXM5-80GB")
    assignment = resolve_precisions(work, {"fc1": "fp8_e4m3"}, h100)
    precision = dict(zip(work.names, map(str, assignment.precision)))
    assert precision["drop"] == "fp32"  # follows fc1's fp32 output, as the operators write it
    assert str(assignment.output[0]) == "fp32" and str(assignment.backward[0]) == "fp8_e5m2"


def test_a_planned_backward_precision_is_what_the_op_runs_backward():
    work = op_work(trace_graph(_Block(), torch.randn(2, 8)))
    a100 = load_catalog().device("A100-SXM4-80GB")
    assignment = resolve_precisions(work, {"fc1": {"forward": "int8", "backward": "bf16"}}, a100)
    assert str(assignment.backward[0]) == "bf16"
    assert assignment.config(0).backward_precision.value == "bf16"
