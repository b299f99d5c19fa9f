"""The simulated vLLM fleet (``python -m epick.sim serve``) in a child process, for the
tests that route real proxies to it (tests/envoy, tests/dataplanes).

    with sim_fleet(3) as addresses: ...   # "127.0.0.1:<port>" each, all listening
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["SIM_MODEL", "sim_fleet"]

SIM_MODEL = "sim-base"


@contextmanager
def sim_fleet(replicas: int = 3, *, adapters: int = 4, max_lora: int = 2) -> Iterator[list[str]]:
    """``replicas`` simulated replicas (real-time driver); their addresses."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "epick.sim", "serve", "--replicas", str(replicas),
         "--adapters", str(adapters), "--max-lora", str(max_lora)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        addresses: list[str] = []
        buf = b""
        deadline = time.monotonic() + 30
        while len(addresses) < replicas:
            left = deadline - time.monotonic()
            assert left > 0 and proc.poll() is None, "the simulated fleet did not start"
            if select.select([proc.stdout], [], [], left)[0]:
                buf += os.read(proc.stdout.fileno(), 4096)
                *lines, buf = buf.split(b"\n")
                addresses += [ln.split()[1].decode() for ln in lines if ln.startswith(b"READY ")]
        yield addresses
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
