import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph
from qsync_lab.indicator.quality import indicator_quality, measure_truth
from qsync_lab.quant import apply_plan_

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
    assert (truth[["kl", "grad_deviation", "loss_increase", "loss_ci95"]] == 0).all().all()


def test_kl_truth_matches_torch_kl_div_on_the_quantized_outputs():
    model, _, heldout = mlp_with_outlier()
    truth = measure_truth(model, heldout, LOSS, ["2"], "int8", progress=False)
    quantized = copy.deepcopy(model)
    apply_plan_(quantized, {"2": "int8"})
    expected = sum(F.kl_div(quantized(x).log_softmax(-1), model(x).log_softmax(-1),
                            log_target=True, reduction="batchmean").item()
                   for x, _ in heldout) / len(heldout)
    assert truth.loc["2", "kl"] == pytest.approx(expected, rel=1e-4)
    assert truth.loc["2", "kl"] > 0


def test_loss_interval_is_the_student_t_interval_of_the_batch_increases():
    model, _, heldout = mlp_with_outlier()
    truth = measure_truth(model, heldout, LOSS, ["2"], "int8", progress=False)
    quantized = copy.deepcopy(model)
    apply_plan_(quantized, {"2": "int8"})
    deltas = [LOSS(quantized(x), y).item() - LOSS(model(x), y).item() for x, y in heldout]
    assert truth.loc["2", "loss_increase"] == pytest.approx(sum(deltas) / 2, rel=1e-4)
    # two batches: t(0.975, 1) * |d1 - d2| / sqrt(2) / sqrt(2)
    assert truth.loc["2", "loss_ci95"] == pytest.approx(
        12.7062 * abs(deltas[0] - deltas[1]) / 2, rel=1e-3)


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
    assert list(report.correlations.columns) == ["ops", "rho_kl", "rho_grad", "rho_loss"]
    assert report.correlations[["rho_kl", "rho_grad"]].stack().between(-1, 1).all()
    assert table["kl"].idxmax() == "2"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_quality_needs_batches():
    model, calibration, _ = mlp_with_outlier()
    graph = trace_graph(model, calibration[0][0])
    with pytest.raises(QSyncError, match="at least one calibration batch"):
        indicator_quality(model, graph, calibration, [], "int8", loss_fn=LOSS, progress=False)
