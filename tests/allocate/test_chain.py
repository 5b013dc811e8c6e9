"""The chain's per-op memory estimate is the simulator's memory model."""

import pytest
import torch
import torch.nn as nn

from qsync_lab.allocate import chain_costs, op_choices
from qsync_lab.costs import CostModel, op_work
from qsync_lab.devices import load_catalog
from qsync_lab.graph import trace_graph
from qsync_lab.policy import resolve_precisions
from qsync_lab.precision import Precision
from qsync_lab.simulate import PlanEvaluator
from qsync_lab.simulate.memory import MemoryModel


def test_memory_columns_are_the_memory_models_under_uniform_plans(small_case):
    prepared, cluster, costs, scores = small_case
    evaluator = PlanEvaluator(prepared, cluster, costs)
    work, t4, memory = prepared.work, evaluator.devices["T4"], evaluator.memory_model
    choices = op_choices(work, scores, t4)
    chain = chain_costs(work, choices.ops, t4, costs, batch_size=32, memory=memory)
    for c, p in enumerate(chain.precisions):
        uniform = resolve_precisions(work, dict.fromkeys(choices.ops, p), t4)
        held = memory.saved(uniform, batch_size=32) + memory.weight_copies(uniform)
        assert chain.mem_bytes[:, c].sum() == pytest.approx(held.sum())
    # the second linear (4096 -> 2048) and the ReLU after it, at 32 x 64 rows: fp32 shares
    # the ReLU's output before it (counted with the first linear) and the ReLU keeps its
    # own; fp16 keeps both in fp16, plus its weight copy; int8 keeps an int8 copy of its
    # input, which the fp32 ReLU before it keeps anyway, so it holds more than fp32
    rows, weights = 32 * 64, 4096 * 2048 + 2048
    expected = {Precision.FP32: rows * 2048 * 4, Precision.FP16: weights * 2 + rows * 2048 * 2,
                Precision.INT8: weights + rows * 4096 + rows * 2048 * 4}
    assert work.kinds[choices.ops[1]:choices.ops[2]] == ("linear", "activation")
    assert {p: chain.mem_bytes[1, chain.column(p)] for p in expected} == expected


class _NormThenThree(nn.Module):
    """A layer norm whose output three linears read (q, k and v)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.q, self.k, self.v = (nn.Linear(64, 64) for _ in range(3))

    def forward(self, x):
        h = self.norm(x)
        return self.q(h) + self.k(h) + self.v(h)


def test_a_layer_norm_stays_fp32_in_the_16_bit_column():
    """A 16-bit layer norm saves nothing of its own (it computes on fp32 inputs), so the
    16-bit column keeps it fp32, as a plan of least risk does: each 16-bit linear after it
    keeps its own 16-bit copy of the norm's fp32 output (not a third of a shared 16-bit
    one); in fp32 the three share the norm's output."""
    graph = trace_graph(_NormThenThree(), torch.randn(2, 64))
    work, t4 = op_work(graph), load_catalog().device("T4")
    memory = MemoryModel(work, graph.params, optimizer="sgd", bucket_bytes=0.0)
    ops = tuple(work.index_of(name) for name in ("norm", "q", "k", "v"))
    chain = chain_costs(work, ops, t4, CostModel(), batch_size=256, memory=memory)
    fp16, fp32 = chain.column(Precision.FP16), chain.column(Precision.FP32)
    assert chain.mem_bytes[0, fp16] == chain.mem_bytes[0, fp32]
    weights = 64 * 64 + 64
    for k in (1, 2, 3):
        assert chain.mem_bytes[k, fp32] == pytest.approx(256 * 64 * 4 / 3)
        assert chain.mem_bytes[k, fp16] == 256 * 64 * 2 + weights * 2
