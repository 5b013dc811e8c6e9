"""One policy, four readers: for every op kind, precision and catalog device, the simulator
accepts a one-op plan iff ``apply_plan_`` runs it iff the allocator may choose it iff the
indicator scores it (and the device runs its forward and backward precisions)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qsync_lab.allocate.choices import op_choices
from qsync_lab.cluster import load_cluster
from qsync_lab.costs import CostModel, op_work
from qsync_lab.devices import load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph
from qsync_lab.indicator import indicator
from qsync_lab.models import MatMul
from qsync_lab.policy import DEFAULT_BACKWARD, PLANNABLE_KINDS, forward_refusal
from qsync_lab.precision import Precision
from qsync_lab.quant import apply_plan_
from qsync_lab.simulate import simulate

BATCH, TOKENS, WIDTH = 4, 8, 8


class EveryKind(nn.Module):
    """One op of every plannable kind (modules and functional calls), plus followers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.rms = nn.RMSNorm(WIDTH)
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.act = nn.ReLU()
        self.mm = MatMul()
        self.soft = nn.Softmax(-1)
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.conv1 = nn.Conv1d(WIDTH, WIDTH, 3, padding=1)
        self.conv2 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.pool = nn.MaxPool2d(2)
        self.kernel = nn.Parameter(torch.randn(4, 4, 1, 1) / 2)
        self.conv3 = nn.Conv3d(1, 2, 3, padding=1)
        self.head = nn.Linear(2 * 4 * 4 * 4, 3)

    def forward(self, ids):
        x = self.act(self.lin(self.rms(self.ln(self.emb(ids)))))
        attention = self.soft(self.mm(x, x.transpose(1, 2)))
        x = F.linear(attention @ x, self.w)  # functional matmul and linear
        y = self.conv1(x.transpose(1, 2)).reshape(-1, 1, WIDTH, TOKENS)
        z = self.pool(self.gn(self.bn(self.conv2(y))))
        z = F.conv2d(z, self.kernel)  # a functional conv: not plannable
        return self.head(self.conv3(z.unsqueeze(1)).flatten(1))


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (BATCH, TOKENS), generator=g), torch.randint(0, 3, (BATCH,),
                                                                           generator=g)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model, loss = EveryKind(), nn.CrossEntropyLoss()
    ids, target = _batch(0)
    graph = trace_graph(model, ids, target=target, loss_fn=loss)
    scores = indicator(model, graph, [_batch(1)], loss_fn=loss, num_batches=1, progress=False)
    return model, graph, scores


def _ran(model, fqn, precision, device, runs):
    """Whether apply_plan_ accepts the one-op plan and the model then trains a step."""
    try:
        planned = copy.deepcopy(model)
        apply_plan_(planned, {fqn: precision}, device=device)
    except QSyncError:
        return False
    key = (fqn, precision)
    if key not in runs:  # the step does not depend on the device
        ids, target = _batch(2)
        loss = nn.functional.cross_entropy(planned(ids), target)
        loss.backward()
        runs[key] = bool(torch.isfinite(loss))
    return runs[key]


def _simulated(graph, fqn, precision, device, tmp_path):
    path = tmp_path / f"{device.name}.toml"
    if not path.exists():
        path.write_text(f'name = "one"\n[[node]]\nname = "n0"\n'
                        'intra_node_link = { bandwidth_GBps = 10, latency_us = 5 }\n'
                        f'devices = [{{ kind = "{device.name}", count = 1, '
                        f'batch_size = {BATCH} }}]\n')
    try:
        simulate(graph, {device.name: {fqn: precision}}, load_cluster(path), CostModel())
    except QSyncError:
        return False
    return True


def test_every_reader_agrees_for_every_kind_precision_and_device(setup, tmp_path):
    model, graph, scores = setup
    work = op_work(graph)
    ops = ["emb", "ln", "rms", "lin", "act", "mm", "soft", "matmul", "linear", "conv1", "conv2",
           "bn", "gn", "pool", "conv2d", "conv3"]
    assert set(ops) <= set(graph.ops.index)
    kinds = {graph.ops.at[fqn, "kind"] for fqn in ops}
    assert set(PLANNABLE_KINDS) <= kinds  # every plannable kind is exercised
    runs, disagreements, accepted = {}, [], 0
    for device in load_catalog().devices.values():
        choices = op_choices(work, scores, device)
        ladders = {work.names[op]: set(ladder) for op, ladder in zip(choices.ops, choices.ladders)}
        for fqn in ops:
            for p in Precision:
                if p is Precision.FP32:
                    continue
                scored = fqn in scores.index and bool(pd_finite(scores.at[fqn, (str(p), "risk")]))
                runs_on_device = (device.supports(p) and device.supports(DEFAULT_BACKWARD[p])
                                  and forward_refusal(p, device) is None)
                verdict = {
                    "simulator": _simulated(graph, fqn, p, device, tmp_path),
                    "apply_plan_": _ran(model, fqn, p, device, runs),
                    "allocator": p in ladders.get(fqn, set()),
                    "indicator": scored and runs_on_device,
                }
                accepted += verdict["simulator"]
                if len(set(verdict.values())) > 1:
                    disagreements.append((device.name, fqn, str(p), verdict))
    assert not disagreements, disagreements[:5]
    assert accepted > 100  # the table is not empty


def pd_finite(value) -> bool:
    return value == value and value not in (float("inf"), float("-inf"))
