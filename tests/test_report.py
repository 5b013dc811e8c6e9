"""The plan report: one self-contained HTML file whose numbers are the simulator's."""

import re

import pytest

from qsync_lab.cli import main
from qsync_lab.report import _number, precision_counts, rank_classes, write_report
from qsync_lab.simulate import simulate
from qsync_lab.study import Study

FIGURES = 5  # timeline, memory, precision map, strategies, indicator


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A study, a plan that quantizes the T4's ops, its file and its report."""
    folder = tmp_path_factory.mktemp("report")
    study = Study("digits_mlp", cluster="local-hybrid", progress=False)
    plan = study.plan(strategy="uniform-low")
    plan.save(folder / "plan.json")
    page = write_report(plan, folder / "report.html", study=study).read_text(encoding="utf-8")
    return study, plan, folder, page


def test_the_report_inlines_plotly_js_once_and_draws_every_figure(planned):
    from plotly.offline import get_plotlyjs

    _, _, folder, page = planned
    assert page.startswith("<!DOCTYPE html>")
    assert page.count(get_plotlyjs()) == 1
    assert page.count('class="plotly-graph-div"') == FIGURES
    assert page.count("Plotly.newPlot(") == FIGURES
    assert not re.search(r"<(script|link)[^>]+(src|href)=", page)  # no network needed
    assert sorted(p.name for p in folder.iterdir()) == ["plan.json", "report.html"]


def test_the_summary_numbers_are_the_simulators(planned):
    study, plan, _, page = planned
    sim = simulate(study.graph, plan)  # the plan's own cluster and optimizer
    assert f"<td>{_number(sim.iteration_us / 1e3)}</td>" in page
    assert f"<td>{_number(sim.throughput_samples_per_s)}</td>" in page
    for (device, batch), ranks, *numbers in rank_classes(sim).itertuples():
        cells = [f"<th>{device}</th>", f"<th>{batch}</th>", f"<td>{ranks}</td>",
                 *(f"<td>{_number(x)}</td>" for x in numbers)]  # busy, idle ms; peak GiB
        assert "\n      ".join(cells) in page
    counts = precision_counts(plan)
    assert counts["low_precision_ops"].to_dict() == plan.low_precision_ops()
    assert counts.loc["T4", "low_precision_ops"] > 0
    assert "digits_mlp on local-hybrid: uniform-low" in page


def test_the_cli_reports_a_plan_file_with_the_same_numbers(planned, capsys, tmp_path):
    study, plan, folder, _ = planned
    out = tmp_path / "cli_report.html"
    code = main(["report", "--plan", str(folder / "plan.json"), "--out", str(out)])
    assert code == 0 and capsys.readouterr().out == f"wrote {out}\n"
    page = out.read_text(encoding="utf-8")
    sim = simulate(study.graph, plan)
    assert f"<td>{_number(sim.iteration_us / 1e3)}</td>" in page
    assert page.count('class="plotly-graph-div"') == FIGURES
    assert [p.name for p in tmp_path.iterdir()] == ["cli_report.html"]  # no temp file left


@pytest.mark.parametrize("case,message", [
    ("missing plan", "cannot read plan"),
    ("unreadable plan", "cannot read plan"),
    ("under a file", "is a file, not a folder; choose another --out"),
    ("the plan itself", "is also an input of this command: writing would replace it"),
    ("symlink", "refusing to write through the symlink"),
    ("folder", "is a folder"),
])
def test_bad_input_is_one_line_and_writes_nothing(planned, capsys, tmp_path, case, message):
    plan, out = planned[2] / "plan.json", tmp_path / "report.html"
    if case == "missing plan":
        plan = tmp_path / "no_plan.json"
    elif case == "unreadable plan":
        plan = tmp_path / "garbage.json"
        plan.write_text("{not json")
    elif case == "under a file":
        (tmp_path / "afile").write_text("kept")
        out = tmp_path / "afile" / "report.html"
    elif case == "the plan itself":
        plan = out = tmp_path / "plan.json"
        plan.write_bytes((planned[2] / "plan.json").read_bytes())
    elif case == "symlink":
        (tmp_path / "target.html").write_text("kept")
        out.symlink_to(tmp_path / "target.html")
    else:
        out.mkdir()
    kept = out.read_bytes() if out.is_file() else None
    before = sorted(tmp_path.rglob("*"))
    code = main(["report", "--plan", str(plan), "--out", str(out)])
    _, err = capsys.readouterr()
    assert code == 2 and err.startswith("qsync-lab: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert sorted(tmp_path.rglob("*")) == before
    assert (out.read_bytes() if out.is_file() else None) == kept
    if case == "symlink":
        assert out.is_symlink() and (tmp_path / "target.html").read_text() == "kept"


def test_a_study_of_another_model_is_refused(planned, tmp_path):
    from qsync_lab.errors import QSyncError

    _, plan, _, _ = planned
    other = Study("digits_cnn", cluster="local-hybrid", progress=False)
    with pytest.raises(QSyncError, match="another model"):
        write_report(plan, tmp_path / "report.html", study=other)
    assert not list(tmp_path.iterdir())


def test_a_plan_made_under_a_budget_is_reported_and_compared_under_it(tmp_path, capsys):
    """A plan made at a tight T4 budget: the report shows that budget (summary and memory
    figure), and its strategies re-plan under it, so its qsync row is the plan's own."""
    import json

    from qsync_lab.report import compare_as_planned

    study = Study("resnet18", cluster="local-hybrid", calibration_batches=1, progress=False)
    default = study.plan()
    budget = round(0.9 * study.simulate(default).tensor_peak_bytes.max() / 2**30, 3)
    plan = study.plan(memory_limit={"T4": budget})
    assert plan.low_precision_ops()["T4"] != default.low_precision_ops()["T4"]  # it matters
    table = compare_as_planned(plan, study)
    assert table.loc["qsync", "low_precision_ops[T4]"] == plan.low_precision_ops()["T4"]
    plan.save(tmp_path / "plan.json")
    page = write_report(tmp_path / "plan.json", tmp_path / "report.html", study=study,
                        comparison=table).read_text(encoding="utf-8")
    assert f"T4 {budget:g} GiB; throughput: the fastest kind at fp32 sets the pace" in page
    assert "Strategies compared (the plan&#x27;s constraints)" in page
    limits = re.findall(r'"name":"limit"[^}]*?"y":\[([^\]]*)\]', page)
    assert [float(y) for y in limits[0].split(",")] == [32.0, budget]
    old = json.loads((tmp_path / "plan.json").read_text())
    old["_data"].pop("constraints")  # a plan file from before plans recorded them
    (tmp_path / "old.json").write_text(json.dumps(old))
    page = write_report(tmp_path / "old.json", tmp_path / "old.html", study=study,
                        comparison=table).read_text(encoding="utf-8")
    assert "constraints not recorded" in page and "(default constraints: the plan" in page
