"""Small models, clusters and indicators for the allocator tests."""

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn

from qsync_lab.cluster import load_cluster
from qsync_lab.costs import CostModel
from qsync_lab.graph import trace_graph
from qsync_lab.simulate import prepare_graph


def mlp_graph(widths: list[int], tokens: int = 64):
    """An MLP of linears (ReLU between) traced on ``(4, tokens, widths[0])`` inputs."""
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return trace_graph(nn.Sequential(*layers[:-1]), torch.randn(4, tokens, widths[0]))


def synthetic_indicator(graph, seed: int = 0) -> pd.DataFrame:
    """Random per-op risks for the linears: fp16 in [0.1, 1), int8 2-10x that."""
    rng = np.random.default_rng(seed)
    linears = graph.ops.index[graph.ops["kind"] == "linear"]
    fp16 = rng.uniform(0.1, 1.0, len(linears))
    return pd.DataFrame({("fp16", "risk"): fp16,
                         ("int8", "risk"): fp16 * rng.uniform(2, 10, len(linears))},
                        index=linears)


@pytest.fixture(scope="session")
def small_case():
    """(prepared graph, cluster, costs, indicator): a 5-linear MLP on v100-t4-small."""
    torch.manual_seed(0)
    graph = mlp_graph([1024, 4096, 2048, 4096, 1024, 1024])
    return prepare_graph(graph), load_cluster("v100-t4-small"), CostModel(), \
        synthetic_indicator(graph)


@pytest.fixture(scope="session")
def make_mlp():
    """``(widths, seed) -> (graph, indicator)``: an MLP and a synthetic indicator for it."""
    def make(widths: list[int], seed: int = 0):
        torch.manual_seed(seed)
        graph = mlp_graph(widths)
        return graph, synthetic_indicator(graph, seed)
    return make
