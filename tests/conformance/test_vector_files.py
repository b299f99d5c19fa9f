"""The built-in vector sets: they load, cover every kind, and explain every expectation."""

from __future__ import annotations

import pytest

from epick.conformance import vectors
from epick.conformance.schema import KINDS, Case, Check, Pick, State

BUILTIN = sorted(vectors.VECTORS_DIR.glob("*.toml"))


@pytest.mark.parametrize("path", BUILTIN, ids=[p.name for p in BUILTIN])
def test_every_builtin_file_loads_and_every_expectation_says_why(path):
    vf = vectors.load_file(path)

    assert vf.cases, f"{path.name} has no cases"
    for case in vf.cases:
        whys = whys_of(case)
        assert whys and all(w.strip() for w in whys), f"{case.name}: an expectation without a why"


def _per(why, n: int) -> list[str]:
    return list(why) if isinstance(why, tuple) else [why] * n


def whys_of(case: Case) -> list[str]:
    """Every derivation a case carries: its call's, each step's, its stats' or host's."""
    n = len(case.candidate_indices)
    out = _per(case.expect.why, n) if case.expect is not None else []
    for step in case.steps:
        if isinstance(step, Check):
            k = len(step.candidates) if step.candidates is not None else len(case.snapshot.endpoints)
            out += _per(step.expect.why, k)
        elif isinstance(step, (Pick, State)):
            out.append(step.why)
    if case.stats is not None:
        out += _per(case.stats.why, n)
    elif case.host is not None:
        out.append(case.host.expect.why)
    return out


@pytest.mark.parametrize("kind", [*[k for k in KINDS if k != "custom"], "host"])
def test_every_builtin_kind_has_vectors_with_unique_names(kind):
    cases = vectors.load(kind)

    names = [c.name for c in cases]
    assert len(names) == len(set(names))
    assert len(cases) >= 5


def test_the_custom_kind_has_no_builtin_vectors():
    assert vectors.load("custom") == []


def test_the_seed_lora_table_rows_each_decide_some_expectation():
    rows = {"base-model", "running", "room", "waiting", "otherwise"}
    seen = set()
    for c in vectors.load("lora-affinity"):
        if c.name.startswith("lora/seed/"):
            for why in whys_of(c.case):
                seen.add(why.split(":")[0].split(" (")[0])
    assert rows <= seen
