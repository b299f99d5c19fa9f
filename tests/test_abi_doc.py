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
