"""The demo's report of a run, and its HTML report of the paper-scale plan."""

from qsync_lab.demo import _explain_step_error, _paper_scale


def test_a_large_step_error_is_explained_from_the_measured_steps(capsys):
    warmup = [{"step_ms": [50.0, 60.0]}] * 2  # left out, as the summary's median leaves them
    timed = [{"step_ms": [t, t - 1.0]} for t in (107.0, 100.0, 101.0, 106.0, 102.0, 105.0,
                                                 103.0, 104.0)]
    _explain_step_error({"warmup_steps": 2, "measured_step_ms": 103.5}, warmup + timed)
    out = capsys.readouterr().out
    assert "middle half spans 102.0-106.0 ms (4 % of the median)" in out  # slowest rank's steps
    assert "1-min load average is" in out and "\n" not in out.rstrip("\n")


def test_the_paper_part_writes_a_report_beside_the_plan_and_prints_its_path(capsys, tmp_path):
    _paper_scale(tmp_path, "digits_mlp", "local-hybrid")
    out = capsys.readouterr().out
    report = tmp_path / "paper_report.html"
    assert f"and the report {report} (open it in a browser)" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["paper_plan.json", "paper_report.html",
                                                          "paper_trace.json"]
    page = report.read_text(encoding="utf-8")
    assert "digits_mlp on local-hybrid: qsync" in page
    assert page.count('class="plotly-graph-div"') == 5
