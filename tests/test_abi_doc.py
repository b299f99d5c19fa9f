"""policies/ABI.md documents the payload layouts; host/abi.py defines them. They agree."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from epick import abi

ABI_MD = (Path(__file__).resolve().parents[1] / "policies" / "ABI.md").read_text()


def documented_layout(title: str) -> list[str]:
    """The ``[a, b, c]`` line under ``### title`` in ABI.md."""
    section = ABI_MD.split(f"### {title}\n", 1)[1]
    match = re.search(r"`\[([^\]]*)\]`", section)
    assert match, f"ABI.md: no layout line under '### {title}'"
    return [f.strip().rstrip("?") for f in match.group(1).split(",")]


@pytest.mark.parametrize("title, struct", [
    ("Snapshot", abi.Snapshot),
    ("EndpointMetrics", abi.EndpointMetrics),
    ("Request", abi.Request),
    ("ScoreInput (input of `score` and `filter`)", abi.ScoreInput),
    ("PreRequestEvent", abi.PreRequestEvent),
    ("PostResponseEvent", abi.PostResponseEvent),
], ids=lambda v: v if isinstance(v, str) else "")
def test_documented_field_order_matches_the_structs(title, struct):
    assert documented_layout(title) == list(struct.__struct_fields__)


def test_payloads_are_msgpack_arrays_in_declared_order():
    ep = abi.EndpointMetrics(address="a:1", waiting=3, running_adapters=("x",))
    assert msgspec.msgpack.decode(abi.encoder.encode(ep)) == [
        "a:1", 3, 0, 0.0, ["x"], [], 0, 0, 0, 0]


def test_describe_is_a_map_with_the_documented_keys():
    d = abi.Describe(name="n")
    assert set(msgspec.msgpack.decode(abi.encoder.encode(d))) == {"name", "version", "kind",
                                                                   "params"}
    for key in ("`name`", "`version`", "`kind`", "`params`"):
        assert key in ABI_MD.split("### Describe", 1)[1]


def test_abi_version_is_documented():
    assert f"returns `{abi.ABI_VERSION}`" in ABI_MD


def _table_rows(section: str) -> list[list[str]]:
    """The rows of the first table after ``section``'s first line that contains a '#'
    header, each as its cells (stripped, backticks removed)."""
    text = ABI_MD.split(section, 1)[1]
    rows = []
    started = False
    for line in text.splitlines():
        if line.startswith("| #"):
            started = True
            continue
        if started:
            if not line.startswith("|"):
                break
            if line.startswith("|---"):
                continue
            rows.append([c.strip().strip("`") for c in line.strip("|").split("|")])
    return rows


def test_the_score_frame_header_is_documented_word_by_word():
    rows = _table_rows("Header words:")
    assert [(int(r[0]), r[1]) for r in rows] == list(enumerate(abi.FRAME_HEADER))
    assert abi.FRAME_HEADER_BYTES == 32 and "| 0–31 | header: 8 `u32` words" in ABI_MD


def test_the_score_frame_arrays_are_score_inputs_and_documented_in_order():
    section = ABI_MD.split("Per-candidate arrays, in this order", 1)[1]
    listed = re.search(r"`\[([^\]]*)\]`", section).group(1)
    assert [f.strip() for f in listed.split(",")] == list(abi.FRAME_ARRAYS)
    rows = _table_rows("Per-candidate arrays, in this order")
    assert [(int(r[0]), r[1]) for r in rows] == list(enumerate(abi.FRAME_ARRAYS))
    for row in rows:
        assert row[2].split()[0] == str(abi.FRAME_EMPTY[row[1]])


def test_the_carried_event_status_is_documented():
    assert f"the call returns **`{abi.FRAME_EVENT_FAILED}`**" in ABI_MD


def test_every_abi_version_is_documented():
    assert abi.ABI_VERSIONS == (1, 2)
    for v in abi.ABI_VERSIONS:
        assert f"**Version {v}**" in ABI_MD
