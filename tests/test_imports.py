"""The layer table of docs/design.md ("Layers") and the import-linter contracts that enforce
it (pyproject.toml, ``[tool.importlinter]``; ``make lint`` runs ``lint-imports``).

The table is the human-readable statement, the contracts are what runs: these tests keep
the two equal (a failing run prints the contracts the table asks for, ready to paste),
keep every unit of the package in the table, and show on a small package that the
contracts catch a forbidden import — lazy ones inside functions included.
"""

from __future__ import annotations

import os
import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import epick

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
PYPROJECT = ROOT / "pyproject.toml"
MARKER = "<!-- import-rules:"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


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


def contracts_for(rules: dict[str, set[str] | None]) -> list[dict]:
    """The import-linter contracts that say what the table says: one ``forbidden``
    contract per restricted unit, over direct imports only (a unit may use what its
    allowed units import: ``allow_indirect_imports``)."""
    units = sorted(rules)
    out = []
    for unit in units:
        allowed = rules[unit]
        if allowed is None:
            continue
        names = ", ".join(sorted(a.removeprefix("epick.") for a in allowed)) or "nothing"
        out.append({
            "name": f"{unit} may import {names}",
            "type": "forbidden",
            "source_modules": [unit],
            "forbidden_modules": [u for u in units if u != unit and u not in allowed],
            "allow_indirect_imports": True,
        })
    return out


def as_toml(contracts: list[dict]) -> str:
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list):
            return "[" + ", ".join(f'"{x}"' for x in v) + "]"
        return f'"{v}"'

    return "\n".join("[[tool.importlinter.contracts]]\n" + "".join(
        f"{k} = {value(v)}\n" for k, v in c.items()) for c in contracts)


def package_units() -> set[str]:
    """Every top-level module and subpackage of ``epick``: host/'s, and those pyproject
    maps from elsewhere (epick.conformance)."""
    found = {f"epick.{m.name}" for m in pkgutil.iter_modules(epick.__path__)}
    listed = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["packages"]
    return found | {p for p in listed if p.count(".") == 1}


@pytest.fixture(scope="module")
def rules() -> dict[str, set[str] | None]:
    return read_rules(DESIGN.read_text())


@pytest.fixture(scope="module")
def config() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]


def test_the_contracts_are_the_table(rules, config):
    expected = contracts_for(rules)
    assert config["contracts"] == expected, (
        "pyproject.toml's [tool.importlinter] contracts differ from docs/design.md's table; "
        "the table asks for:\n\n" + as_toml(expected))
    assert config["root_packages"] == ["epick"]


def test_every_unit_of_the_package_has_a_row_and_every_row_a_unit(rules):
    units = package_units()
    assert len(units) > 20  # the walk found the package
    assert sorted(units - set(rules)) == [], "add a row to docs/design.md's table (\"Layers\")"
    named = set(rules) | {u for allowed in rules.values() if allowed for u in allowed}
    assert sorted(named - units) == []


def test_interfaces_is_a_leaf_over_abi(rules):
    assert rules["epick.interfaces"] == {"epick.abi"}
    for layer in ("epick.runtime", "epick.pool", "epick.scheduler"):
        others = {"epick.runtime", "epick.pool", "epick.scheduler"} - {layer}
        assert "epick.interfaces" in rules[layer] and not rules[layer] & others, layer


def _lint(tmp_path: Path, files: dict[str, str], config: dict) -> subprocess.CompletedProcess:
    """lint-imports with the real contracts over a small ``epick`` made of ``files`` plus
    an empty module for every other unit (a contract names them all)."""
    pkg = tmp_path / "epick"
    for unit in package_units():
        (pkg / unit.split(".")[1]).mkdir(parents=True, exist_ok=True)
        (pkg / unit.split(".")[1] / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    contracts = config["contracts"]
    (tmp_path / "pyproject.toml").write_text(
        '[tool.importlinter]\nroot_packages = ["epick"]\n\n' + as_toml(contracts))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # this epick before the installed one
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_contracts_pass_a_package_that_follows_the_table(tmp_path, config):
    run = _lint(tmp_path, {
        "interfaces/cycle.py": "from epick import abi\n",
        "scheduler/scheduler.py": "from epick.interfaces import cycle\n",
        "kv/routing.py": "import epick.pool\nfrom epick.config import x\n",
    }, config)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "BROKEN" not in run.stdout


def test_a_lazy_forbidden_import_breaks_the_contract_and_is_named(tmp_path, config):
    run = _lint(tmp_path, {
        # the runtime reaching back into the scheduler, lazily inside a function
        "runtime/plugin.py": "def f():\n    from epick.scheduler import scheduler\n",
        "scheduler/scheduler.py": "",
    }, config)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "epick.runtime may import abi, interfaces, ratelog BROKEN" in run.stdout
    assert "epick.runtime.plugin -> epick.scheduler.scheduler (l.2)" in run.stdout


def test_the_leaf_importing_upwards_breaks_its_contract(tmp_path, config):
    run = _lint(tmp_path, {"interfaces/cycle.py": "from epick import scheduler\n"}, config)
    assert run.returncode == 1
    assert "epick.interfaces may import abi BROKEN" in run.stdout


def test_importing_the_runtime_or_the_pool_loads_no_scheduler():
    code = ("import sys, epick.runtime, epick.pool; "
            "print(sorted(m for m in sys.modules if m.startswith('epick.scheduler')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def write_contracts(path: Path = PYPROJECT) -> None:
    """Rewrite pyproject's contracts from the table (after adding a row):
    ``.venv/bin/python tests/test_imports.py --write``."""
    text = path.read_text()
    marker = "[[tool.importlinter.contracts]]"
    first, last = text.index(marker), text.rindex(marker)
    after = text.index("\n[tool.", last) + 1  # the table that follows the contracts
    body = as_toml(contracts_for(read_rules(DESIGN.read_text())))
    path.write_text(text[:first] + body + "\n" + text[after:])


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: tests/test_imports.py --write")
    write_contracts()
