"""The built-in vector sets: they load, cover every kind, and explain every expectation."""

from __future__ import annotations

import pytest

from epick.conformance import vectors
from epick.conformance.schema import KINDS

BUILTIN = sorted(vectors.VECTORS_DIR.glob("*.toml"))


@pytest.mark.parametrize("path", BUILTIN, ids=[p.name for p in BUILTIN])
def test_every_builtin_file_loads_and_every_expectation_says_why(path):
    vf = vectors.load_file(path)

    assert vf.cases, f"{path.name} has no cases"
    for case in vf.cases:
        whys = [case.why(i) for i in range(len(case.candidate_indices))]
        assert all(w.strip() for w in whys), f"{case.name}: an expectation without a why"


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "custom"])
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
            for i in range(len(c.case.candidate_indices)):
                seen.add(c.case.why(i).split(":")[0].split(" (")[0])
    assert rows <= seen
