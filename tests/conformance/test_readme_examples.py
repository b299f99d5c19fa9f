"""conformance/README.md's examples are valid vector files, and the new kinds of case
(sequence, statistics, host stage) pass against the policies they are written for."""

from __future__ import annotations

import re

import pytest

from epick.conformance import vectors
from epick.conformance.runner import run_case
from epick.policies_build import POLICIES_DIR

README = (POLICIES_DIR.parent / "conformance" / "README.md").read_text()
BLOCKS = re.findall(r"```toml\n(.*?)```", README, re.S)
#: README example case -> (the file kind it is written for, the shipped policy to run)
RUNS = {
    "mine/pick-then-pick": ("lora-affinity", "lora-affinity"),
    "legacy/affinity-draw-frequency": ("legacy-v1", "legacy-v1"),
    "mine/beside-load": ("load", "load"),
}


def test_every_example_with_a_case_loads(tmp_path):
    full = [b for b in BLOCKS if "[[case]]" in b]
    assert len(full) >= 4
    for i, block in enumerate(full):
        path = tmp_path / f"b{i}.toml"
        path.write_text(block if block.lstrip().startswith("kind") else 'kind = "custom"\n' + block)
        vectors.load_file(path)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_example_passes(tmp_path, shipped, name):
    kind, module = RUNS[name]
    (block,) = [b for b in BLOCKS if f'name = "{name}"' in b]
    path = tmp_path / "example.toml"
    path.write_text(f'kind = "{kind}"\n' + block)
    (loaded,) = vectors.load(kind, [path], builtin=False)
    result = run_case(shipped(module), loaded)
    assert result.verdict == "pass", result.why


def test_the_state_example_passes_as_steps_of_a_case(tmp_path, shipped):
    (block,) = [b for b in BLOCKS if '{ event = "state", path = [2, 1, 1, 0]' in b]
    path = tmp_path / "state.toml"
    path.write_text('kind = "lora-affinity"\n[[case]]\nname = "state"\n'
                    'snapshot.timestamp_ms = 1000\n'
                    'snapshot.endpoints = [{ address = "e0:8000", max_lora = 2 }, '
                    '{ address = "e1:8000", max_lora = 2 }]\n' + block)
    (loaded,) = vectors.load("lora-affinity", [path], builtin=False)
    result = run_case(shipped("lora-affinity"), loaded)
    assert result.verdict == "pass", result.why
