"""``benchmarks/gpu_check.sh`` runs only on a lent GPU, so what it calls is checked here:
its shell parses, each module it runs with ``-m`` can be run so, each script and test path
exists, and each option it passes is one that command or script takes."""

import importlib.util
import re
import subprocess
from pathlib import Path

from qsync_lab.cli.parser import build_parser

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _commands() -> list[str]:
    """The script's logical lines (continuations joined), comments dropped."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    return [line.split(" #")[0] for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _options(command: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", command))


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_module_run_with_dash_m_can_be_run():
    modules = {m for line in _commands() for m in re.findall(r"\$PY -m ([\w.]+)", line)}
    assert "qsync_lab" in modules
    for module in modules - {"pytest"}:
        spec = importlib.util.find_spec(module)
        assert spec is not None, module
        if spec.submodule_search_locations is not None:  # a package needs a __main__
            assert importlib.util.find_spec(f"{module}.__main__") is not None, module


def test_every_qsync_lab_command_takes_the_options_passed():
    subparsers = next(action for action in build_parser()._actions
                      if action.choices and "profile" in action.choices).choices
    seen = 0
    for line in _commands():
        for command, rest in re.findall(r"\$PY -m qsync_lab (\w+)(.*?)(?:;;|&&|$)", line):
            taken = set(subparsers[command]._option_string_actions)
            assert _options(rest) <= taken, (command, _options(rest) - taken)
            seen += 1
    assert seen >= 4  # profile, compress, plan, run


def test_every_script_and_test_path_exists_and_takes_its_options():
    scripts = 0
    for line in _commands():
        for script, rest in re.findall(r"\$PY (benchmarks/\w+\.py)(.*?)(?:;;|$)", line):
            source = (ROOT / script).read_text()
            missing = {option for option in _options(rest) if f'"{option}"' not in source}
            assert not missing, (script, missing)
            scripts += 1
        for path in re.findall(r"\s(tests/[\w/.]+)", line):
            assert (ROOT / path).exists(), path
    assert scripts >= 5
