"""The runtime's modules import one way (runtime -> module -> instance, and nothing
inside epick.runtime imports back up): every import counted, lazy ones inside functions
and ``TYPE_CHECKING`` ones included, so a cycle cannot hide in either."""

from __future__ import annotations

import ast
from pathlib import Path

import epick.runtime

RUNTIME = Path(epick.runtime.__file__).parent
PACKAGE = "epick.runtime"


def _imports(file: Path) -> set[str]:
    """The ``epick.runtime.*`` modules ``file`` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == PACKAGE:  # from epick.runtime import X: X may be a module
                names = [f"{PACKAGE}.{a.name}" for a in node.names]
            out.update(n for n in names if n.startswith(PACKAGE + "."))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith(PACKAGE + "."))
    return out


def graph() -> dict[str, set[str]]:
    modules = {f"{PACKAGE}.{f.stem}": f for f in RUNTIME.glob("*.py") if f.stem != "__init__"}
    return {name: _imports(f) & set(modules) for name, f in modules.items()}


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the path that closes it, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_runtime_modules_import_without_a_cycle():
    assert _cycle(graph()) is None


def test_the_layers_point_down():
    g = graph()
    assert f"{PACKAGE}.module" in g[f"{PACKAGE}.runtime"]
    assert f"{PACKAGE}.instance" in g[f"{PACKAGE}.module"]
    assert not g[f"{PACKAGE}.instance"] & {f"{PACKAGE}.module", f"{PACKAGE}.runtime"}
    assert f"{PACKAGE}.runtime" not in g[f"{PACKAGE}.module"]


def test_the_cycle_check_sees_a_cycle():
    """The checker itself: a back edge (lazy or not) is found."""
    g = graph()
    g[f"{PACKAGE}.instance"] = g[f"{PACKAGE}.instance"] | {f"{PACKAGE}.runtime"}
    found = _cycle(g)
    assert found is not None and found[0] == found[-1]
    assert {f"{PACKAGE}.instance", f"{PACKAGE}.runtime"} <= set(found)
