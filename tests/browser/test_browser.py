"""The plan tuner and the HTML report in a real browser: Debian's headless Chromium driven
by selenium. Skipped, with the reason, where chromium, chromedriver, voila or selenium is
missing (``.ci/run`` installs chromium and its driver with apt-get where it can).

``QSYNC_LAB_SCREENSHOTS=1`` also saves the tuner's screenshot as
``benchmarks/results/browser_tuner.png``.
"""

import importlib.util
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qsync_lab.cli.lab import LAB_NOTEBOOK, cull_interval_s, lab_environment, voila_command
from qsync_lab.report import write_report
from qsync_lab.study import Study

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "benchmarks" / "results" / "browser_tuner.png"
TUTORIAL = ROOT / "notebooks" / "04_plan_tuner.ipynb"
LISTEN_S = 60
NOTEBOOK_DONE_S = 240  # Voila runs the whole notebook (the study's first plan) first
REDRAW_S = 60
RENDER_S = 30
STOP_S = 30
RUN_S = 300
IDLE_S = 15  # a closed page's kernel is stopped after this (qsync-lab lab's --idle-s)
T4_MEMORY = "T4 memory (GiB)"
THROUGHPUT = "throughput target (samples/s)"
USABLE_COLD_S = 60  # from the page's request to the first plan drawn (60 s cold)


MISSING = ([str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
           + [m for m in ("selenium", "voila") if importlib.util.find_spec(m) is None])
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (apt-get "
                                "install chromium chromium-driver; pip install "
                                "'qsync_lab[test]')")
if not MISSING:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait


@pytest.fixture
def browser():
    """Headless Chromium (1600 x 1400) through Debian's chromedriver."""
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1600,1400"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


def _serve(notebook: Path, tmp_path: Path, env: dict[str, str]):
    """Voila serving ``notebook`` as ``qsync-lab lab --idle-s`` :data:`IDLE_S` does, behind a
    fresh token: (URL, server pid); stopped (its kernels too) after the test."""
    token = secrets.token_urlsafe(16)
    port = _free_port()
    with open(tmp_path / "voila.log", "w") as log:
        server = subprocess.Popen(voila_command(notebook, port=port, idle_s=IDLE_S), stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "JUPYTER_TOKEN": token, **env})
    _wait_listening(server, port, tmp_path / "voila.log")
    yield f"http://127.0.0.1:{port}/?token={token}", server.pid
    os.killpg(server.pid, signal.SIGTERM)  # Voila shuts its kernel down
    try:
        server.wait(STOP_S)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


@pytest.fixture
def lab_url(tmp_path):
    """The lab app (``qsync-lab lab --model digits_cnn``), exporting into ``tmp_path``."""
    yield from _serve(LAB_NOTEBOOK, tmp_path,
                      lab_environment("digits_cnn", "local-hybrid", tmp_path))


@pytest.fixture
def tuner_url(tmp_path):
    """Tutorial 04, whose cells drive the tuner and save a plain figure."""
    yield from _serve(TUTORIAL, tmp_path, lab_environment("resnet18", "local-hybrid", tmp_path))


def test_a_newcomer_moves_a_slider_exports_and_trains_the_plan(browser, lab_url, tmp_path):
    """Open the lab, lower the T4 budget, export, and train the export with the command the
    lab shows: a summary line predicted for this machine. The page logs no error."""
    begin = time.monotonic()
    browser.get(lab_url[0])
    loaded_s = time.monotonic() - begin
    WebDriverWait(browser, NOTEBOOK_DONE_S).until(lambda d: _summary(d) and _timeline_svg(d))
    usable_s = time.monotonic() - begin
    print(f"lab page loaded in {loaded_s:.1f} s, first plan drawn at {usable_s:.1f} s "
          f"(this test session's cache; load {os.getloadavg()[0]:.2f})")
    assert usable_s < USABLE_COLD_S
    summary = _summary(browser)
    readout = _slider(browser, T4_MEMORY).find_element(By.CSS_SELECTOR, ".widget-readout")
    readout.click()
    readout.send_keys(Keys.CONTROL, "a")
    readout.send_keys("1", Keys.ENTER)
    WebDriverWait(browser, REDRAW_S).until(lambda d: "T4 1 GiB" in summary.text)
    assert "/ 1.00 GiB" in summary.text
    _assert_nothing_clipped(browser)
    target = _slider(browser, THROUGHPUT).find_element(By.CSS_SELECTOR, ".widget-readout")
    target.click()
    target.send_keys(Keys.CONTROL, "a")
    target.send_keys("1e12", Keys.ENTER)  # beyond reach: the last feasible plan stays shown
    WebDriverWait(browser, REDRAW_S).until(lambda d: "still showing" in summary.text)
    _assert_nothing_clipped(browser)
    target.click()
    target.send_keys(Keys.CONTROL, "a")
    target.send_keys("0", Keys.ENTER)
    WebDriverWait(browser, REDRAW_S).until(lambda d: "still showing" not in summary.text)
    _screenshot(browser, tmp_path / "tuner.png", also=os.environ.get("QSYNC_LAB_SCREENSHOTS"))
    next(t for t in browser.find_elements(By.CSS_SELECTOR, ".lm-TabBar-tab")
         if t.text == "export").click()
    next(b for b in browser.find_elements(By.TAG_NAME, "button")
         if b.text == "Export plan").click()
    path = tmp_path / "qsync_export" / "plan.json"
    status = WebDriverWait(browser, RENDER_S).until(
        lambda d: next((h for h in d.find_elements(By.CSS_SELECTOR, ".widget-html")
                        if f"wrote {path}" in h.text), None))
    command = status.find_elements(By.TAG_NAME, "pre")[-1].text
    assert shlex.split(command) == ["qsync-lab", "run", "--plan", str(path)]
    done = subprocess.run([sys.executable, "-m", "qsync_lab", *shlex.split(command)[1:],
                           "--steps", "4", "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=RUN_S, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    summary_file = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary_file["emulating"] and "1 GiB" in summary_file["plan_made_under"]
    assert "predicted" in done.stdout
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors  # nothing fetched from the internet, no script error


def test_the_kernel_of_a_closed_page_is_stopped_and_the_open_ones_kept(browser, lab_url):
    """Two pages of the lab, one closed: Voila culls its idle kernel, the other stays."""
    url, server = lab_url
    browser.get(url)
    WebDriverWait(browser, NOTEBOOK_DONE_S).until(lambda d: _summary(d))
    first = browser.current_window_handle
    browser.switch_to.new_window("tab")
    browser.get(url)
    WebDriverWait(browser, NOTEBOOK_DONE_S).until(lambda d: _summary(d))
    assert len(_kernels(server)) == 2
    browser.close()
    browser.switch_to.window(first)
    deadline = time.monotonic() + IDLE_S + 4 * cull_interval_s(IDLE_S)
    while len(_kernels(server)) > 1 and time.monotonic() < deadline:
        time.sleep(2)
    assert len(_kernels(server)) == 1 and _summary(browser)


def test_a_figure_saved_as_plotly_json_is_drawn(browser, tuner_url):
    """The notebook's plain figure (a ``plotly_mimetype`` output, as every tutorial notebook
    saves its figures) is drawn by the plotly renderer Voila loads, not by a kernel widget."""
    browser.get(tuner_url[0])
    WebDriverWait(browser, NOTEBOOK_DONE_S).until(lambda d: _output_figures(d))
    bars = _output_figures(browser)[0].find_elements(By.CSS_SELECTOR, "g.trace.bars, g.point")
    assert bars, "the timeline figure was drawn without bars"


def test_the_report_renders_every_figure_offline(browser, tmp_path):
    study = Study("digits_mlp", cluster="local-hybrid", progress=False)
    path = write_report(study.plan(), tmp_path / "report.html", study=study)
    figures = path.read_text(encoding="utf-8").count('class="plotly-graph-div"')
    browser.get(path.as_uri())

    def drawn(driver) -> int:
        return sum(bool(f.find_elements(By.CSS_SELECTOR, "svg.main-svg"))
                   for f in driver.find_elements(By.CSS_SELECTOR, ".plotly-graph-div"))

    WebDriverWait(browser, RENDER_S).until(lambda d: drawn(d) == figures)
    assert figures == 5  # timeline, memory, precision map, strategies, indicator
    browser.set_window_size(1280, 1000)  # the strategies table's long headers wrap to fit
    widest = browser.execute_script("return Math.max(...[...document.querySelectorAll("
                                    "'table')].map(t => t.getBoundingClientRect().right))")
    assert widest <= browser.execute_script("return window.innerWidth")
    _screenshot(browser, tmp_path / "report.png")


def _kernels(server: int) -> list:
    """The kernel processes Voila (pid ``server``) runs (a culled one that is gone or not
    yet reaped, a zombie, runs no more)."""
    import psutil

    kernels = []
    for process in psutil.Process(server).children(recursive=True):
        try:
            if "ipykernel" in " ".join(process.cmdline()):
                kernels.append(process)
        except psutil.NoSuchProcess:  # ZombieProcess too
            continue
    return kernels


def _assert_nothing_clipped(browser) -> None:
    """No control of the panel is cut: every widget of the controls column fits inside it,
    and no group of them scrolls sideways."""
    clipped = browser.execute_script("""
        const out = [];
        for (const el of document.querySelectorAll('.widget-vbox, .widget-hbox')) {
            if (el.scrollWidth > el.clientWidth + 1) out.push(el.className);
        }
        return out;""")
    assert not clipped, f"containers that scroll sideways: {clipped}"


def _slider(browser, label: str):
    """The slider whose label is ``label``."""
    return next(s for s in browser.find_elements(By.CSS_SELECTOR, ".widget-slider")
                if s.find_element(By.CSS_SELECTOR, ".widget-label").text == label)


def _summary(browser):
    """The plan summary (the HTML widget that says the predicted step time), or None."""
    return next((h for h in browser.find_elements(By.CSS_SELECTOR, ".widget-html")
                 if "step time predicted" in h.text), None)


def _timeline_svg(browser):
    """The plot of the tuner's first tab (the timeline), or None before it is drawn."""
    return next(iter(browser.find_elements(
        By.CSS_SELECTOR, ".widget-tab .widget-tab-contents > :first-child svg.main-svg")), None)


def _output_figures(browser) -> list:
    """Plotly figures drawn outside any widget (cell outputs), once drawn."""
    return [f for f in browser.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")
            if not f.find_elements(By.XPATH, "ancestor::*[contains(@class, 'widget-tab')]")
            and f.find_elements(By.CSS_SELECTOR, "svg.main-svg")]


def _screenshot(browser, path: Path, *, also: str | None = None) -> None:
    """Save a screenshot at ``path``, and at :data:`SCREENSHOT` when ``also`` is "1"."""
    assert browser.save_screenshot(str(path)), f"no screenshot at {path}"
    if also == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, SCREENSHOT)


def _wait_listening(server: subprocess.Popen, port: int, log: Path) -> None:
    """Return once ``server`` accepts connections on ``port``."""
    deadline = time.monotonic() + LISTEN_S
    while True:
        assert server.poll() is None, log.read_text()[-2000:]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"voila not listening after {LISTEN_S} s"
            time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
