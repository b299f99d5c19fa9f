"""Helpers for the runtime tests: .wat test modules built from source, payload builders.

(A module of its own, not conftest: several test folders have a conftest.py, so
``from conftest import`` would be ambiguous in one pytest run.)

The modules in ``wat/`` are hand-written; ``;; @include NAME`` lines splice in the shared
snippets (``_abi.wat``, ``_msgpack.wat``) and ``{{key}}`` placeholders are filled from
keyword arguments, so one file covers a family of misbehaviours.
"""

from __future__ import annotations

import re
from pathlib import Path

import wasmtime

from epick import abi

WAT_DIR = Path(__file__).parent / "wat"
_INCLUDE = re.compile(r"^\s*;; @include (\S+)\s*$", re.MULTILINE)
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def wat_source(name: str, **subst: object) -> str:
    """The text of ``wat/<name>.wat`` with includes spliced and placeholders filled."""
    text = (WAT_DIR / f"{name}.wat").read_text()
    text = _INCLUDE.sub(lambda m: (WAT_DIR / m.group(1)).read_text(), text)

    def fill(m: re.Match[str]) -> str:
        if m.group(1) not in subst:
            raise KeyError(f"{name}.wat needs {{{{{m.group(1)}}}}}")
        return str(subst[m.group(1)])

    return _PLACEHOLDER.sub(fill, text)


def wasm(name: str, **subst: object) -> bytes:
    """``wat/<name>.wat`` compiled to wasm bytes."""
    return wasmtime.wat2wasm(wat_source(name, **subst))


def snapshot(n: int, *, version: int = 1) -> abi.Snapshot:
    """A snapshot of ``n`` endpoints ``10.0.0.<i>:8000``."""
    return abi.Snapshot(
        version=version,
        timestamp_ms=1_700_000_000_000 + version,
        endpoints=tuple(
            abi.EndpointMetrics(address=f"10.0.0.{i}:8000", waiting=i, kv_usage=0.5)
            for i in range(n)
        ),
    )


def score_input(n: int, *, inline: bool = True) -> bytes:
    """A msgpack ScoreInput over all ``n`` endpoints of :func:`snapshot`."""
    return abi.encoder.encode(
        abi.ScoreInput(
            snapshot=snapshot(n) if inline else None,
            request=abi.Request(model="m"),
            candidates=tuple(range(n)),
        )
    )
