"""The git checkout some benchmarks measure: the test suite's fixtures and harnesses
(``tests/``), the committed examples (``examples/``) and the side venvs (``.venv-envoy``).

Those benchmarks run from a checkout (``make install`` installs this package editable, so
this file is ``host/bench/checkout.py`` inside it); from an installed wheel they stop with
:class:`CheckoutError`, which names the file they needed. The test harnesses stay in
``tests/`` — the package never ships them — and are imported from there the way the tests
import them (their folder on ``sys.path``).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["REPO", "CheckoutError", "path", "tests_module"]

#: The checkout's root: host/bench/checkout.py -> host/bench -> host -> the root.
REPO = Path(__file__).resolve().parents[2]


class CheckoutError(RuntimeError):
    """A file this benchmark reads from the git checkout is not there."""


def path(*parts: str) -> Path:
    """``REPO/parts…``, which must exist."""
    found = REPO.joinpath(*parts)
    if not found.exists():
        raise CheckoutError(f"{found} not found: this benchmark runs from a git checkout of "
                            f"epick (it reads {'/'.join(parts)})")
    return found


def tests_module(folder: str, name: str) -> ModuleType:
    """The module ``tests/<folder>/<name>.py``, imported as pytest imports it: with its
    folder and ``tests/`` on ``sys.path`` (where its own sibling imports resolve)."""
    here = path("tests", folder, f"{name}.py").parent
    for entry in (str(here.parent), str(here)):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    return importlib.import_module(name)
