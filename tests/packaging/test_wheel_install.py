"""`pip install` of a wheel built from this repo gives a working service, used from a
folder that is not the checkout: check-config with the built-in policies, the conformance
suite on a built-in module with its built-in vectors, and `epick serve` answering a Pick
against the simulated fleet (whose page template is package data too).

No network: the wheel goes into a fresh venv with ``--no-deps``, and only then does the
venv borrow the dev venv's dependencies through a ``.pth`` line — a plain path, so the dev
venv's editable-install hook (its own ``.pth`` file) never runs there. The first test
checks that ``epick`` really imports from the fresh venv.
"""

from __future__ import annotations

import os
import shutil
import signal
import site
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.gen.epick.v1 import picker_pb2_grpc

pytestmark = pytest.mark.slow  # builds a wheel, starts a fleet and `epick serve`

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ["load", "prefix-cache", "lora-affinity"]


@dataclass(frozen=True)
class Installed:
    bin: Path
    site_packages: Path
    workdir: Path
    """An empty folder outside the checkout: every command runs there."""

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        return subprocess.run([str(self.bin / args[0]), *args[1:]], cwd=self.workdir, env=env,
                              capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory, source_copy) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(tmp / "dist"), "."],
        cwd=source_copy, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (tmp / "dist").glob("epick-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    # The dev venv's pip installs into the fresh venv (`--python`): no ensurepip needed.
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    (site_packages,) = (venv / "lib").glob("python3*/site-packages")
    # After the install, so pip never saw the dev venv's (editable) epick.
    (site_packages / "dev-dependencies.pth").write_text(
        "\n".join(p for p in site.getsitepackages() if "site-packages" in p) + "\n")
    workdir = tmp / "elsewhere"
    workdir.mkdir()
    return Installed(venv / "bin", site_packages, workdir)


def test_epick_imports_from_the_fresh_venv_not_the_checkout(installed):
    code = ("import epick, epick.builtin, epick.conformance, epick.sim, epick.config as c; "
            "print(epick.__file__); print(epick.builtin.__file__); "
            "print(epick.conformance.__file__); print(epick.sim.__file__); "
            "print(c.resolve_module('load'))")
    out = installed.run("python", "-c", code)
    assert out.returncode == 0, out.stderr
    paths = [Path(line) for line in out.stdout.split()]
    assert len(paths) == 5
    for path in paths:
        assert path.is_relative_to(installed.site_packages), path
    assert paths[-1].is_file()


def test_check_config_accepts_the_example_with_the_builtin_policies(installed):
    shutil.copy(ROOT / "examples" / "epick.toml", installed.workdir / "epick.toml")
    out = installed.run("epick", "check-config", "epick.toml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "epick.toml: ok (version 1, 3 endpoints, 3 policies)" in out.stdout


def test_conformance_passes_a_builtin_module_with_its_builtin_vectors(installed):
    module = installed.site_packages / "epick" / "builtin" / "load.wasm"
    out = installed.run("epick", "conformance", str(module))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    assert "PASS: load (load):" in out.stdout
    assert "load/" in out.stdout  # the built-in vectors ran (their case names), not just properties


def test_serve_answers_a_pick_against_the_simulated_fleet(installed):
    procs: list[subprocess.Popen] = []
    # Whatever happens, nothing started here outlives 120 s (a hung readline included).
    watchdog = threading.Timer(120, lambda: [p.kill() for p in procs])
    watchdog.start()
    try:
        sim = _start(installed, procs, "python", "-m", "epick.sim", "serve", "--replicas", "2",
                     "--adapters", "2")
        lines = [sim.stdout.readline().strip() for _ in range(2)]
        assert all(line.startswith("READY 127.0.0.1:") for line in lines), (
            lines, _stderr(sim))
        addresses = [line.split()[1] for line in lines]
        endpoints = "".join(f'[[pool.endpoints]]\naddress = "{a}"\n' for a in addresses)
        policies = "".join(f'[[policies]]\nname = "{n}"\nmodule = "{n}"\n' for n in POLICIES)
        (installed.workdir / "serve.toml").write_text(
            'version = 1\n[server]\nlisten = "127.0.0.1:0"\nmetrics_listen = ""\n'
            f'[admin]\nlisten = ""\n{endpoints}{policies}')
        serve = _start(installed, procs, "epick", "serve", "--config", "serve.toml")
        line = serve.stdout.readline().strip()
        assert line.startswith("epick: serving Pick on "), (line, _stderr(serve))
        target = line.rsplit(" ", 1)[1]
        with grpc.insecure_channel(target) as channel:
            answer = _pick(picker_pb2_grpc.EndpointPickerStub(channel))
        assert answer.endpoint in addresses
        assert {c.endpoint for c in answer.explanation.candidates} == set(addresses)
        for c in answer.explanation.candidates:
            assert sorted(c.scores) == sorted(POLICIES)
        for proc in reversed(procs):  # epick serve, then the fleet: both exit 0 on SIGTERM
            assert _stop(proc) == 0, _stderr(proc)
    finally:
        watchdog.cancel()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def _start(installed: Installed, procs: list, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.Popen([str(installed.bin / args[0]), *args[1:]], cwd=installed.workdir,
                            env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    procs.append(proc)
    return proc


def _pick(stub: picker_pb2_grpc.EndpointPickerStub) -> pb.PickResponse:
    """The first answered Pick: until the first scrape, no endpoint is fresh (UNAVAILABLE)."""
    request = pb.PickRequest(model="sim-base", adapter="adapter-0", explain=True, seed=1)
    deadline = time.monotonic() + 30
    while True:
        try:
            return stub.Pick(request, timeout=10)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> int:
    """SIGTERM by its PID; the exit status."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
    return proc.wait(timeout=30)


def _stderr(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.kill()
    return proc.stderr.read()[-3000:]
