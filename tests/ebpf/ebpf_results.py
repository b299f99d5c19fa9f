"""``RESULT name: {...}`` lines the tests/ebpf tests record; conftest prints them at the end
of the run (``make test-ebpf`` shows what was measured, not only that it passed)."""

from __future__ import annotations

import json

RESULTS: list[str] = []


def result(name: str, **fields) -> None:
    line = f"RESULT {name}: " + json.dumps(fields, sort_keys=True)
    RESULTS.append(line)
    print(line)
