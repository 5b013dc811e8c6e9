"""``plot_precision_map``'s cells are the plan's precisions in the shared colours;
``plot_comparison``'s bars are ``Study.compare()``'s columns, compression rows included."""

import pandas as pd
import pytest
import torch
import torch.nn as nn

import qsync_lab
from qsync_lab.errors import QSyncError
from qsync_lab.graph import trace_graph
from qsync_lab.viz import PRECISION_COLORS, plot_comparison, plot_precision_map

COMPRESSION = "global_qsgd:8,min_numel=16"


def test_cells_are_the_plans_forward_precisions(plan, graph):
    heatmap, = plot_precision_map(plan, graph).data
    assert list(heatmap.x) == ["0", "2"]  # the Linears; the ReLU is not plannable
    assert list(heatmap.y) == ["V100-SXM2-32GB", "T4"]
    names = heatmap.colorbar.ticktext
    cells = {(kind, op): names[code] for kind, row in zip(heatmap.y, heatmap.z)
             for op, code in zip(heatmap.x, row)}
    assert cells == {("V100-SXM2-32GB", "0"): "fp32", ("V100-SXM2-32GB", "2"): "fp16",
                     ("T4", "0"): "int8", ("T4", "2"): "fp16"}
    assert [_colour_of(heatmap, code) for code in range(len(names))] == [
        PRECISION_COLORS[name] for name in names]


def _colour_of(heatmap, code: int) -> str:
    """The colour a cell of value ``code`` gets: the stops around its place on the scale
    must both have it (a discrete scale)."""
    place = (code - heatmap.zmin) / (heatmap.zmax - heatmap.zmin)
    below = [colour for at, colour in heatmap.colorscale if at <= place][-1]
    above = [colour for at, colour in heatmap.colorscale if at >= place][0]
    assert below == above
    return below


def test_a_plan_for_another_model_is_refused(plan):
    other = trace_graph(nn.Sequential(nn.Linear(8, 8)), torch.randn(2, 8))
    with pytest.raises(QSyncError, match="another model"):
        plot_precision_map(plan, other)


@pytest.fixture(scope="module")
def table():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    study = qsync_lab.Study(model, (torch.randn(8, 16), torch.randint(0, 4, (8,))),
                            progress=False)
    return study.compare(compressions=[COMPRESSION])


def test_comparison_bars_are_the_tables_columns(table):
    fig = plot_comparison(table)
    strategies = table.index.tolist()
    assert strategies[-1] == f"qsync+{COMPRESSION}"
    throughput, *per_kind = fig.data
    assert list(throughput.x) == strategies
    assert list(throughput.y) == table["throughput_samples_per_s"].tolist()
    assert list(throughput.text) == ["" if ok else "below target" for ok in table["meets_target"]]
    assert [row[2] for row in throughput.customdata] == table["compression"].tolist()
    # the "device kind" legend lists the kinds only
    assert [t.name for t in fig.data if t.showlegend is not False] == ["V100-SXM2-32GB", "T4"]
    kinds = ["V100-SXM2-32GB", "T4"]
    assert [(t.name, t.yaxis) for t in per_kind] == [(k, "y2") for k in kinds] + [
        (k, "y3") for k in kinds]
    for trace, column in zip(per_kind, [f"{p}[{k}]" for p in ("low_precision_ops",
                                                                  "tensor_peak_gib")
                                           for k in kinds]):
        assert list(trace.y) == table[column].tolist()


def test_a_table_without_the_comparison_columns_is_refused(table):
    with pytest.raises(QSyncError, match="no column 'meets_target'"):
        plot_comparison(table.drop(columns="meets_target"))
    with pytest.raises(QSyncError, match="tensor_peak_gib"):
        plot_comparison(pd.DataFrame({c: [] for c in table.columns
                                      if not c.startswith("tensor_peak_gib")}))


def test_the_indicator_figure_draws_the_risk_the_allocator_minimises():
    from qsync_lab import Study
    from qsync_lab.viz import plot_indicator

    scores = Study("digits_mlp", cluster="local-hybrid", progress=False).indicator()
    (bars,) = plot_indicator(scores, "int8", top=3).data
    top3 = scores[("int8", "risk")].sort_values(ascending=False)[:3]
    assert bars.name == "risk" and list(bars.x) == list(top3.index)
    assert list(bars.y) == top3.tolist()
    with pytest.raises(QSyncError, match="value must be 'risk' or 'omega'"):
        plot_indicator(scores, "int8", value="fisher")
