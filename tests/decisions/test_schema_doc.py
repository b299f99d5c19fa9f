"""policies/DECISIONS.md documents every record of host/decisions/schema.py, in order."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from epick.decisions import schema

DOC = (Path(__file__).resolve().parents[2] / "policies" / "DECISIONS.md").read_text()
RECORDS = [schema.Header, schema.Module, schema.Policies, schema.SnapshotRec,
           schema.DecisionRec, schema.CompletionRec, schema.Checkpoint, schema.Recovered,
           schema.Gap]


def row(kind: str) -> str:
    for line in DOC.splitlines():
        if line.startswith(f"| `{kind}`"):
            return line
    raise AssertionError(f"DECISIONS.md has no row for record kind {kind!r}")


@pytest.mark.parametrize("rec", RECORDS, ids=lambda r: r.__name__)
def test_every_field_is_documented_in_its_order(rec):
    info = msgspec.inspect.type_info(rec)
    text = row(info.tag).split("|")[2]
    pos = 0
    for f in info.fields:
        m = re.compile(rf"\b{f.name}\b").search(text, pos)
        assert m, f"{rec.__name__}.{f.name} missing (or out of order) in: {text}"
        pos = m.end()


def test_the_request_features_are_documented_in_order():
    info = msgspec.inspect.type_info(schema.RequestFeatures)
    names = re.search(r"`d\.request` is `\[([^\]]*)\]`", DOC.replace("\n  ", " ")).group(1)
    assert [n.strip().rstrip("?") for n in names.split(",")] == [f.name for f in info.fields]


def test_the_abi_points_to_this_document():
    abi_doc = (Path(__file__).resolve().parents[2] / "policies" / "ABI.md").read_text()
    assert "DECISIONS.md" in abi_doc
