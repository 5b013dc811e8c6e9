"""``plot_prediction``: a measured and a predicted bar per run (medians over rows of one
label), with the prediction's error written on it, from summaries or benchmark rows."""

import pandas as pd
import pytest

from qsync_lab.errors import QSyncError
from qsync_lab.viz import plot_prediction


def _summary(measured_ms, predicted_ms, measured_mib=2.0, predicted_mib=2.5):
    """The keys of a run's summary.json that the figure reads, and some it does not."""
    return {"model": "mlp", "cluster": "local-hybrid", "measured_step_ms": measured_ms,
            "predicted_step_ms": predicted_ms, "measured_tensor_peak_mib": measured_mib,
            "predicted_tensor_peak_mib": predicted_mib, "ranks": [{"rank": 0}]}


def test_one_summary_gives_one_pair_with_its_error():
    measured, predicted = plot_prediction(_summary(8.0, 10.0)).data
    assert (list(measured.x), list(measured.y), list(predicted.y)) == (["mlp"], [8.0], [10.0])
    assert list(predicted.text) == ["+25.0 %"]
    memory = plot_prediction(_summary(8.0, 10.0), metric="tensor_peak_mib").data
    assert [list(t.y) for t in memory] == [[2.0], [2.5]]


def test_labels_name_the_runs_of_one_model():
    runs = [_summary(10.0, 9.0), _summary(20.0, 22.0)]
    measured, predicted = plot_prediction(runs, labels=["fp32", "qsync"]).data
    assert list(predicted.x) == ["fp32", "qsync"]
    assert list(predicted.text) == ["-10.0 %", "+10.0 %"]


def test_benchmark_rows_are_drawn_as_medians_over_their_rounds():
    rows = pd.DataFrame({"round": [0, 0, 1, 1, 2, 2],
                         "model": ["cnn"] * 6, "plan": ["fp32", "bf16"] * 3,
                         "step_ms": [5.0, 6.0, 7.0, 6.5, 6.0, 9.0],
                         "pred_ms": [4.0, 5.0, 4.5, 5.5, 6.0, 4.0],
                         "peak_MiB": [1.0] * 6, "pred_MiB": [1.1] * 6})
    measured, predicted = plot_prediction(rows).data
    assert list(measured.x) == ["cnn fp32", "cnn bf16"]
    assert list(measured.y) == [6.0, 6.5]
    assert list(predicted.y) == [4.5, 5.0]
    assert list(predicted.text) == ["-25.0 %", "-23.1 %"]


def test_bad_input_raises_one_line_errors():
    with pytest.raises(QSyncError, match="unknown metric 'loss'"):
        plot_prediction(_summary(1.0, 1.0), metric="loss")
    with pytest.raises(QSyncError, match="no step_ms pair"):
        plot_prediction([{"model": "mlp", "step_ms": 1.0}])
    with pytest.raises(QSyncError, match="1 labels for 2 runs"):
        plot_prediction([_summary(1.0, 1.0)] * 2, labels=["a"])
