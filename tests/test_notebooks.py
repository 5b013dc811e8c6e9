"""The tutorial notebooks are saved as they ran: numbered 01-07, every code cell executed
top to bottom in one run, no error outputs, figures saved as plotly JSON (drawn without a
kernel by JupyterLab's, Voila's and VS Code's plotly renderer), and small: no plotly.js and no
widget state (a plotly ``FigureWidget`` carries plotly.js, ~5 MB) in the file. nbval re-runs
them and compares the cells marked ``# NBVAL_CHECK_OUTPUT`` (``pytest --nbval-lax
notebooks/``, part of the default test run).

A notebook saved without running (or edited after its run) fails here: execute it with
``jupyter nbconvert --to notebook --execute --inplace
--ExecutePreprocessor.store_widget_state=False notebooks/NN_name.ipynb``.
"""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
REQUIRED = {"01", "02", "03", "04", "05", "06", "07"}
NAME = re.compile(r"(0[1-7])_[a-z0-9_]+\.ipynb")
PLOTLY_JS = re.compile(r"\* plotly\.js v\d")  # the licence header of the bundle
PLOTLY_JSON = "application/vnd.plotly.v1+json"
MAX_BYTES = 2**20


def _paths() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def test_the_notebooks_are_numbered_01_to_07():
    names = [p.name for p in _paths()]
    assert all(NAME.fullmatch(n) for n in names), f"not NN_name.ipynb (01-07): {names}"
    numbers = [NAME.fullmatch(n).group(1) for n in names]
    assert len(numbers) == len(set(numbers)), f"two notebooks share a number: {names}"
    assert set(numbers) == REQUIRED, f"expected {sorted(REQUIRED)}, found {names}"


@pytest.mark.parametrize("path", _paths(), ids=lambda p: p.name)
def test_the_notebook_opens_with_what_it_shows_and_its_runtime(path):
    first = _cells(path)[0]
    text = _text(first["source"])
    assert first["cell_type"] == "markdown" and text.startswith(f"# {path.name[:2]}"), \
        f"{path.name}: the first cell must be a markdown title '# {path.name[:2]} ...'"
    assert re.search(r"runtime", text, flags=re.I), f"{path.name}: the first cell states no runtime"


@pytest.mark.parametrize("path", _paths(), ids=lambda p: p.name)
def test_every_code_cell_ran_once_top_to_bottom(path):
    code = [c for c in _cells(path) if c["cell_type"] == "code" and _text(c["source"]).strip()]
    counts = [c.get("execution_count") for c in code]
    assert None not in counts, f"{path.name}: {counts.count(None)} code cells never ran; execute " \
                               "and save the notebook"
    assert counts == list(range(1, len(code) + 1)), \
        f"{path.name}: execution counts {counts}: not one run from the top; re-execute it"


@pytest.mark.parametrize("path", _paths(), ids=lambda p: p.name)
def test_no_cell_saved_an_error(path):
    errors = [f"{o.get('ename')}: {o.get('evalue')}" for c in _cells(path)
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: {errors}"


@pytest.mark.parametrize("path", _paths(), ids=lambda p: p.name)
def test_figures_are_saved_as_plotly_json_without_plotly_js(path):
    outputs = [o for c in _cells(path) for o in c.get("outputs", [])]
    bundles = [o for o in outputs
               if any(PLOTLY_JS.search(_text(v)) for v in o.get("data", {}).values())]
    assert not bundles, f"{path.name}: plotly.js saved in {len(bundles)} outputs; set " \
                        "plotly.io.renderers.default = 'plotly_mimetype' before the first figure"
    figures = [o["data"][PLOTLY_JSON] for o in outputs if PLOTLY_JSON in o.get("data", {})]
    assert figures, f"{path.name}: no figure saved as plotly JSON"  # every notebook draws some
    assert all(f.get("data") for f in figures), f"{path.name}: a saved figure has no traces"


def test_no_notebook_saves_widget_state():
    saved = [p.name for p in _paths()
             if "widgets" in json.loads(p.read_text(encoding="utf-8"))["metadata"]]
    assert not saved, f"widget state saved in {saved} (plotly.js inside); execute with " \
                      "--ExecutePreprocessor.store_widget_state=False"


@pytest.mark.parametrize("path", _paths(), ids=lambda p: p.name)
def test_the_notebook_stays_small(path):
    size_mib = path.stat().st_size / 2**20
    assert path.stat().st_size <= MAX_BYTES, \
        f"{path.name}: {size_mib:.1f} MiB saved (limit {MAX_BYTES / 2**20:.0f} MiB)"
