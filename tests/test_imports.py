"""The import rules of docs/design.md ("Layers"), checked over the real import graph.

The graph is computed with ``ast`` from every source file of the ``epick`` package
(``host/`` and the folders ``pyproject.toml`` maps into it), lazy imports inside
functions included; the rules are read from the table in docs/design.md, so the two
cannot drift apart.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
MARKER = "<!-- import-rules:"


@dataclass(frozen=True)
class Edge:
    importer: str  # a module, e.g. epick.runtime.plugin
    imported: str  # a module, e.g. epick.scheduler.framework
    where: str  # file:line


def package_roots(root: Path = ROOT) -> dict[str, Path]:
    """``epick`` and its subpackages that live outside host/, as pyproject maps them."""
    doc = tomllib.loads((root / "pyproject.toml").read_text())
    dirs = doc["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in dirs.items()}


def module_name(package: str, folder: Path, file: Path) -> str:
    parts = [*package.split("."), *file.relative_to(folder).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(roots: Mapping[str, Path]) -> tuple[list[Edge], set[str]]:
    """Every ``epick`` import in the source files under ``roots``, and the modules seen."""
    files: dict[str, Path] = {}
    for package, folder in roots.items():
        for file in folder.rglob("*.py"):
            name = module_name(package, folder, file)
            files[name] = file
    edges = []
    modules = set(files)
    for name, file in sorted(files.items()):
        is_package = file.name == "__init__.py"
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join([*here, *([base] if base else [])])
                # ``from epick import abi`` imports the module epick.abi
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in dict.fromkeys(targets):
                if target == "epick" or target.startswith("epick."):
                    edges.append(Edge(name, target, f"{file.relative_to(ROOT)}:{node.lineno}"
                                      if file.is_relative_to(ROOT) else f"{file}:{node.lineno}"))
    return edges, modules


def read_rules(text: str) -> dict[str, set[str] | None]:
    """unit -> the units it may import (``None``: any), from the table after MARKER."""
    lines = text[text.index(MARKER):].splitlines()[1:]
    rules: dict[str, set[str] | None] = {}
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        unit = cells[0].strip("`")
        if not unit.startswith("epick"):
            continue  # the header and the |---| line
        allowed = re.findall(r"`([^`]+)`", cells[1])
        rules[unit] = None if allowed == ["*"] else {f"epick.{a}" for a in allowed}
    return rules


def unit_of(module: str, units: Iterable[str]) -> str | None:
    """The longest unit that is ``module`` or contains it."""
    best = None
    for unit in units:
        if (module == unit or module.startswith(unit + ".")) and (
                best is None or len(unit) > len(best)):
            best = unit
    return best


def violations(edges: Iterable[Edge], modules: Iterable[str],
               rules: Mapping[str, set[str] | None]) -> list[str]:
    """Each import a rule forbids, and each module no rule covers, in words."""
    out = []
    for module in sorted(modules):
        if module != "epick" and unit_of(module, rules) is None:
            out.append(f"{module} belongs to no unit: add a row for it to the table in "
                       "docs/design.md (\"Layers\")")
    for e in edges:
        src, dst = unit_of(e.importer, rules), unit_of(e.imported, rules)
        if src is None or dst is None or src == dst:
            continue  # no unit: reported above (or the root `epick`, always allowed)
        allowed = rules[src]
        if allowed is not None and dst not in allowed:
            out.append(f"{e.where}: {e.importer} imports {e.imported}, but {src} may import "
                       f"only {', '.join(sorted(allowed)) or 'nothing'}")
    return out


@pytest.fixture(scope="module")
def rules() -> dict[str, set[str] | None]:
    return read_rules(DESIGN.read_text())


def test_the_real_import_graph_follows_the_rules(rules):
    edges, modules = import_graph(package_roots())
    assert len(modules) > 100 and len(edges) > 250  # the walk found the whole package
    assert violations(edges, modules, rules) == []


def test_the_rules_name_only_units_that_exist(rules):
    _, modules = import_graph(package_roots())
    named = set(rules) | {u for allowed in rules.values() if allowed for u in allowed}
    assert sorted(u for u in named if u not in modules) == []


def test_interfaces_is_a_leaf_over_abi(rules):
    assert rules["epick.interfaces"] == {"epick.abi"}
    for layer in ("epick.runtime", "epick.pool", "epick.scheduler"):
        others = {"epick.runtime", "epick.pool", "epick.scheduler"} - {layer}
        assert "epick.interfaces" in rules[layer] and not rules[layer] & others, layer


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        path = tmp_path / "host" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"epick": tmp_path / "host"}


def test_a_forbidden_import_is_reported_with_file_and_line(tmp_path, rules):
    roots = _tree(tmp_path, {
        "__init__.py": "",
        "abi.py": "",
        "interfaces/__init__.py": "from epick import abi\n",
        "scheduler/__init__.py": "",
        "scheduler/scheduler.py": "from epick.interfaces import Cycle\n",
        # the runtime reaching back into the scheduler, lazily inside a function
        "runtime/plugin.py": "def f():\n    from epick.scheduler.scheduler import Scheduler\n",
        "runtime/__init__.py": "from . import plugin\n",
    })
    edges, modules = import_graph(roots)
    found = violations(edges, modules, rules)
    assert len(found) == 1, found
    assert "runtime/plugin.py:2: epick.runtime.plugin imports epick.scheduler.scheduler" in found[0]
    assert "epick.runtime may import only epick.abi, epick.interfaces, epick.ratelog" in found[0]


def test_the_leaf_importing_upwards_is_reported(tmp_path, rules):
    roots = _tree(tmp_path, {"interfaces/cycle.py": "from epick import scheduler\n",
                             "scheduler/__init__.py": ""})
    edges, modules = import_graph(roots)
    assert [v.split(": ", 1)[1] for v in violations(edges, modules, rules)] == [
        "epick.interfaces.cycle imports epick.scheduler, but epick.interfaces may import "
        "only epick.abi"]


def test_a_module_outside_every_unit_is_reported(tmp_path, rules):
    roots = _tree(tmp_path, {"newthing.py": "import epick.abi\n"})
    edges, modules = import_graph(roots)
    assert violations(edges, modules, rules) == [
        "epick.newthing belongs to no unit: add a row for it to the table in docs/design.md "
        "(\"Layers\")"]


def test_importing_the_runtime_or_the_pool_loads_no_scheduler():
    import subprocess
    import sys

    code = ("import sys, epick.runtime, epick.pool; "
            "print(sorted(m for m in sys.modules if m.startswith('epick.scheduler')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"
