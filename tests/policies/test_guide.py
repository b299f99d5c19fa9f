"""policies/README.md (the write-your-own guide) stays true to the SDK it documents."""

from __future__ import annotations

import re
from pathlib import Path

POLICIES = Path(__file__).resolve().parents[2] / "policies"


def _struct_fields(zig: str, struct: str) -> list[tuple[str, str]]:
    body = re.search(rf"^pub const {struct} = struct \{{\n(.*?)^\}};", zig, re.M | re.S)
    assert body, f"sdk/abi.zig: no struct {struct}"
    return re.findall(r"^    (\w+): ([^=]+?) = ", body.group(1), re.M)


def test_the_guide_lists_every_field_of_ctx_endpoint_with_its_type():
    guide = (POLICIES / "README.md").read_text()
    fields = _struct_fields((POLICIES / "sdk" / "abi.zig").read_text(), "Endpoint")
    assert len(fields) == 10
    for name, zig_type in fields:
        assert re.search(rf"^   \| `{name}` \| `{re.escape(zig_type.strip())}` \|", guide,
                         re.M), f"policies/README.md: ctx.endpoint(i).{name} is not listed"


def test_the_guide_names_every_request_field():
    guide = (POLICIES / "README.md").read_text()
    request_doc = guide[guide.index("`ctx.request` has the request"):][:600]
    for name, _ in _struct_fields((POLICIES / "sdk" / "abi.zig").read_text(), "Request"):
        assert f"`{name}`" in request_doc, name


def test_the_guide_example_declares_the_panic_handler_the_sdk_requires():
    guide = (POLICIES / "README.md").read_text()
    assert "pub const panic = sdk.panic;" in guide
    for main in POLICIES.glob("*/main.zig"):
        assert "pub const panic = sdk.panic;" in main.read_text(), main
