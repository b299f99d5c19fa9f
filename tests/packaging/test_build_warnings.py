"""Installing epick prints no setuptools warnings (a newcomer's first `make demo` showed
~100 lines of BuildBackendWarning before anything else), and the wheel carries its data."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _build(args: list[str], cwd: Path, env: dict | None = None) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_a_wheel_builds_without_warnings_and_ships_its_data(tmp_path, source_copy):
    out = _build(["-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                  "-q", "-w", str(tmp_path), "."], source_copy)
    assert "Warning" not in out, out
    (wheel,) = tmp_path.glob("epick-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for toml in (ROOT / "conformance" / "vectors").glob("*.toml"):
        assert f"epick/conformance/vectors/{toml.name}" in names
    modules = sorted((ROOT / "host" / "builtin").glob("*.wasm"))
    assert modules  # the built-in policies (make policies)
    for wasm in modules:
        assert f"epick/builtin/{wasm.name}" in names
    assert "epick/sim/vllm_page.txt" in names


def test_the_editable_install_make_runs_prints_no_warnings(tmp_path):
    makefile = (ROOT / "Makefile").read_text()
    quiet = re.search(r'^PIP_QUIET := PYTHONWARNINGS="([^"]*)"$', makefile, re.MULTILINE)
    assert quiet, "Makefile: PIP_QUIET sets PYTHONWARNINGS for pip install"
    assert "$(PIP_QUIET) $(PY) -m pip install" in makefile
    code = f"from setuptools import build_meta as b; b.build_editable({str(tmp_path)!r})"
    out = _build(["-c", code], ROOT, env={"PYTHONWARNINGS": quiet.group(1)})
    assert "Warning" not in out and "!!" not in out, out
