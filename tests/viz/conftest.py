"""A 3-op MLP on ``local-hybrid`` (a V100 and a T4 rank) under a mixed plan: the T4 runs
op 0 in int8 and op 2 in fp16, the V100 op 2 in fp16."""

import pytest
import torch
import torch.nn as nn

from qsync_lab.cluster import load_cluster
from qsync_lab.graph import trace_graph
from qsync_lab.plan import Plan
from qsync_lab.simulate import simulate

MIXED = {"T4": {"0": "int8", "2": "fp16"}, "V100-SXM2-32GB": {"2": "fp16"}}


@pytest.fixture(scope="session")
def graph():
    torch.manual_seed(0)
    return trace_graph(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)),
                       torch.randn(4, 16))


@pytest.fixture(scope="session")
def cluster():
    return load_cluster("local-hybrid")


@pytest.fixture(scope="session")
def plan(graph, cluster):
    return Plan.build(graph, cluster, MIXED, strategy="manual")


@pytest.fixture(scope="session")
def sim(graph, plan):
    return simulate(graph, plan)
