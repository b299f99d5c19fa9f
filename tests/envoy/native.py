"""The native ext_proc worker for the tests: built with ``make native`` (Debian's gRPC;
the Makefile installs it with apt-get when missing), or the test fails saying why."""

from __future__ import annotations

import inspect
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


def collect(module, namespace: dict, *, skip: tuple[str, ...] = ()) -> None:
    """Every ``test_*`` function of ``module`` that starts epick (an ``epick`` or ``stack``
    argument), and every fixture, into ``namespace`` (a test module's globals), so they
    run again there with that module's ``epick``."""
    for name in dir(module):
        value = getattr(module, name)
        if name in namespace or any(s in name for s in skip):
            continue
        if name.startswith("test_"):
            params = inspect.signature(value).parameters
            if "epick" in params or "stack" in params:
                namespace[name] = value
        elif type(value).__name__ == "FixtureFunctionDefinition" or hasattr(
                value, "_pytestfixturefunction"):
            namespace[name] = value
