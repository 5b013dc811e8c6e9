"""The package's layering: no import cycles between subpackages or between modules,
``import qsync_lab`` light, every subpackage packaged."""

import ast
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qsync_lab"


def _unit(module: str) -> str | None:
    """The subpackage (or top-level module) of ``qsync_lab.<unit>...``."""
    parts = module.split(".")
    if parts[0] != "qsync_lab" or len(parts) < 2:
        return None
    return parts[1]


def _import_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(ROOT).with_suffix("")
        source = _unit(".".join(relative.parts).removesuffix(".__init__"))
        if source is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in map(_unit, targets):
                if target is not None and target != source:
                    edges[source].add(target)
    return edges


def _module_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from a.b import c`` is ``a.b.c`` when that
    is a module, else ``a.b``); a module's own parent packages are left out, as Python has
    imported them before the module runs."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    for source, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t if t in modules else node.module for t in names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges[source].update(t for t in targets if t in modules and t != source
                                 and not source.startswith(t + "."))
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_subpackages_import_each_other_without_cycles():
    edges = _import_graph()
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def test_modules_import_each_other_without_cycles():
    edges = _module_graph()
    assert edges["qsync_lab.simulate.evaluator"]  # the graph sees module imports
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def test_the_layers_point_one_way():
    edges = _import_graph()
    bottom = {"errors", "precision", "policy", "optimizers", "io", "tomlfile", "resources"}
    for unit in bottom:  # the bottom layer never reaches into the planner or the runner
        assert not edges[unit] & {"simulate", "allocate", "indicator", "quant", "runtime",
                                  "study", "cli"}, (unit, edges[unit])
    for unit in ("quant", "compress"):  # the operators read the policy, never the planner
        assert not edges[unit] & {"allocate", "simulate", "indicator", "runtime", "study"}
    # the runner may time a model before training it; profiling never starts a run
    assert "runtime" not in edges["profile"]


def test_the_simulator_never_reaches_the_ddp_hook():
    """The simulator costs compression from the method registry, never loading the hook
    (nor, through it, torch.distributed and the kernels), directly or through another module."""
    edges = _module_graph()
    reached, todo = set(), [m for m in list(edges) if m.startswith("qsync_lab.simulate")]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(edges.get(module, ()))
    assert "qsync_lab.compress.methods" in reached  # the graph sees the registry
    assert "qsync_lab.compress.hook" not in reached


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_import_qsync_lab_is_light():
    code = ("import sys, qsync_lab; print(sorted(m for m in ('torch', 'numba', 'plotly', "
            "'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_every_subpackage_is_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {"qsync_lab." + ".".join(p.parent.relative_to(PACKAGE).parts)
             for p in PACKAGE.rglob("__init__.py")} - {"qsync_lab."}
    assert found <= listed, found - listed
