"""The native ext_proc worker for the tests: built with ``make native`` (Debian's gRPC;
the Makefile installs it with apt-get when missing), or the test fails saying why."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def build_native() -> Path:
    done = subprocess.run(["make", "-s", "native"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"`make native` failed (the native front end's tests need it):\n"
                    f"{done.stdout}\n{done.stderr}")
    from epick.frontend.supervisor import native_binary

    return native_binary()
