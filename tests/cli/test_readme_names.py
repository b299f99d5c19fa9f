"""The field names the README shows after its grpcurl commands are the names grpcurl
prints. grpcurl reads the descriptors through reflection and prints the proto's own field
names (``filtered_by``), not protobuf's JSON names (``filteredBy``), so the test asks the
real grpcurl rather than deriving the spelling."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from epick_service import make_config, running
from fakes import vllm_page

from epick.api.gen.epick.v1 import picker_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or "grpcurl"
# The messages a Pick answer is made of: what the README's paragraph talks about.
PICK_MESSAGES = (pb.PickResponse, pb.Explanation, pb.CandidateExplanation)


def readme_paragraph() -> str:
    """The README's words on the demo's answers: from the demo block to "Chat requests"."""
    text = (ROOT / "README.md").read_text()
    start = text.index("<!-- demo-commands:")
    start = text.index("```\n", text.index("```\n", start) + 4) + 4
    return text[start:text.index("Chat requests", start)]


def proto_field_names() -> set[str]:
    """Every spelling a field of the Pick answer could take: proto name and JSON name."""
    names: set[str] = set()
    for message in PICK_MESSAGES:
        for field in message.DESCRIPTOR.fields:
            names |= {field.name, field.json_name}
    return names


def keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value).union(*(keys(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(keys(v) for v in value))
    return set()


def test_the_readme_names_fields_as_grpcurl_prints_them(fake_vllm, tmp_path):
    named = set(re.findall(r"`([A-Za-z_]+)`", readme_paragraph())) & proto_field_names()
    assert {"rank", "explanation"} <= named, named  # the paragraph still talks about fields
    servers = [fake_vllm(vllm_page(waiting=q)) for q in (0, 2)]
    with running(make_config([s.address for s in servers], tmp=tmp_path)) as svc:
        deadline = time.monotonic() + 15
        while True:  # until the first scrape made an endpoint fresh
            r = subprocess.run(
                [GRPCURL, "-plaintext", "-emit-defaults", "-d",
                 '{"model": "m", "explain": true}', svc.target, "epick.v1.EndpointPicker/Pick"],
                capture_output=True, text=True, timeout=30)
            if r.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert r.returncode == 0, r.stderr
    printed = keys(json.loads(r.stdout))
    # -emit-defaults prints every field, so each name the README may show is there.
    assert {"filtered_by", "shadow_scores", "rank"} <= printed, printed
    assert named <= printed, f"README names {sorted(named - printed)}; grpcurl prints {sorted(printed)}"
