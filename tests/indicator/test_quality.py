import pytest
import torch
import torch.nn as nn

from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph
from qsync_lab.indicator.quality import indicator_quality, measure_truth

LOSS = nn.CrossEntropyLoss()


def mlp_with_outlier():
    """Three linears; the middle one has one huge weight, so its int8 step is coarse."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    with torch.no_grad():
        model[2].weight[0, 0] = 40 * model[2].weight.abs().max()
    data = [(torch.randn(64, 16), torch.randint(0, 4, (64,))) for _ in range(4)]
    return model, data[:2], data[2:]


def test_fp32_truth_is_exactly_zero():
    model, _, heldout = mlp_with_outlier()
    truth = measure_truth(model, heldout, LOSS, ["0", "2", "4"], "fp32", progress=False)
    assert (truth["loss_increase"] == 0).all() and (truth["grad_deviation"] == 0).all()


def test_the_outlier_layer_is_the_most_damaging_and_ranked_first():
    model, calibration, heldout = mlp_with_outlier()
    graph = trace_graph(model, calibration[0][0], target=calibration[0][1], loss_fn=LOSS)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = indicator_quality(model, graph, calibration, heldout, "int8", loss_fn=LOSS,
                               hawq_samples=2, progress=False)
    table = report.table
    assert table["grad_deviation"].idxmax() == "2"
    assert table["qsync"].idxmax() == "2"
    assert (table["grad_deviation"] > 0).all()
    assert table["fisher"].idxmax() == "2"
    assert list(report.correlations.index) == ["qsync", "fisher", "hawq", "wvar", "random"]
    assert (report.correlations["ops"] == 3).all()
    assert report.correlations["rho_grad"].between(-1, 1).all()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_quality_needs_batches():
    model, calibration, _ = mlp_with_outlier()
    graph = trace_graph(model, calibration[0][0])
    with pytest.raises(QSyncError, match="at least one calibration batch"):
        indicator_quality(model, graph, calibration, [], "int8", loss_fn=LOSS, progress=False)
