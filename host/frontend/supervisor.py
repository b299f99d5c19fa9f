"""Owns the front-end worker processes: starts N, restarts one that dies, stops them all.

``run`` is a lifespan task: it reports started once every worker has said hello (its
ext_proc server listens), and on cancellation terminates each worker (SIGTERM, then
SIGKILL after ``stop_grace_s``) and waits for it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec

__all__ = ["Workers", "WorkersDidNotStart", "native_binary", "resolve_frontend"]

log = logging.getLogger("epick.frontend")

#: Restart backoff: doubles from the first to the last while a worker keeps dying young.
RESTART_BACKOFF_S = (0.1, 5.0)
#: A worker that ran this long before it died is restarted at once (backoff reset).
HEALTHY_RUN_S = 10.0


def native_binary() -> Path:
    """The native ext_proc worker (``[server] frontend = "native"``): ``make native`` builds
    it next to its source; ``EPICK_EXTPROC_BINARY`` names another. FileNotFoundError, saying
    how to build it, when it is missing."""
    path = Path(os.environ.get("EPICK_EXTPROC_BINARY")
                or Path(__file__).parent / "native" / "epick-extproc")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(
            f"[server] frontend = \"native\" needs the native ext_proc worker at {path}, "
            "which is missing: build it with `make native` (Debian's libgrpc++-dev), or set "
            "frontend = \"python\"")
    return path


def resolve_frontend(frontend: str, *, workers: int = 1, http: bool = False
                     ) -> tuple[str, str]:
    """``[server] frontend`` as it will be served, and why: ``auto`` is ``native`` when the
    native worker is built (``native_binary``), else ``python`` (a wheel without it, a
    checkout before ``make native``) — and ``python`` when ``[http]`` is on with ``workers``
    > 1, which Python's workers serve in N processes and native would leave to the
    service's one; ``python`` and ``native`` are themselves."""
    if frontend != "auto":
        return frontend, "set in [server] frontend"
    if workers > 1 and http:
        return "python", (f"[http] is on with workers = {workers}: the Python workers serve "
                          "it and ext_proc in every worker process")
    try:
        path = native_binary()
    except FileNotFoundError:
        where = os.environ.get("EPICK_EXTPROC_BINARY") or "next to its source"
        return "python", (f"no native ext_proc worker ({where}; `make native` builds it)")
    return "native", f"the native ext_proc worker is built: {path}"


class WorkersDidNotStart(RuntimeError):
    """Not every worker said hello within the start timeout: names which."""


class Workers:
    """``count`` workers, each started from ``spec(index)`` (a msgspec Struct given to the
    worker on stdin). Call :meth:`hello` when worker ``index`` says it listens (the hub's
    ``on_hello``). ``command``: the argv every worker runs, or a function of the index
    giving it (the native workers' settings are arguments)."""

    def __init__(self, count: int, spec: Callable[[int], msgspec.Struct], *,
                 start_timeout_s: float = 60.0, stop_grace_s: float = 5.0,
                 command: list[str] | Callable[[int], list[str]] | None = None) -> None:
        self.count = count
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.command = command or [sys.executable, "-m", "epick.frontend.worker"]
        self.pids: dict[int, int] = {}
        """index -> the pid of its running process."""
        self.restarts = 0
        self._ready = [anyio.Event() for _ in range(count)]
        self._said_hello: dict[int, int] = {}

    def hello(self, index: int, pid: int) -> None:
        if 0 <= index < self.count and self.pids.get(index) == pid:
            self._said_hello[index] = pid
            self._ready[index].set()

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            for i in range(self.count):
                tg.start_soon(self._keep, i)
            with anyio.move_on_after(self.start_timeout_s):
                for event in self._ready:
                    await event.wait()
            late = [i for i, event in enumerate(self._ready) if not event.is_set()]
            if late:
                raise WorkersDidNotStart(
                    f"front-end worker{'s' if len(late) > 1 else ''} "
                    f"{', '.join(map(str, late))} did not start within "
                    f"{self.start_timeout_s:.0f} s ([server] workers = {self.count}; their own "
                    f"log lines above say why, e.g. a port they cannot bind)")
            log.info("%d front-end workers serving (pids %s)", self.count,
                     ", ".join(str(self.pids[i]) for i in sorted(self.pids)))
            task_status.started()

    async def _keep(self, index: int) -> None:
        backoff = RESTART_BACKOFF_S[0]
        while True:
            began = time.monotonic()
            code = await self._run_once(index)
            ran = time.monotonic() - began
            if ran >= HEALTHY_RUN_S:
                backoff = RESTART_BACKOFF_S[0]
            log.warning("front-end worker %d exited (%s) after %.1f s; restarting in %.1f s",
                        index, f"code {code}" if code >= 0 else f"signal {-code}", ran,
                        backoff)
            self.restarts += 1
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_S[1])

    async def _run_once(self, index: int) -> int:
        command = self.command(index) if callable(self.command) else self.command
        proc = await anyio.open_process(command, stdin=subprocess.PIPE, stdout=None,
                                        stderr=None)
        self.pids[index] = proc.pid
        try:
            await proc.stdin.send(msgspec.json.encode(self.spec(index)))
            await proc.stdin.aclose()
            return await proc.wait()
        finally:
            self.pids.pop(index, None)
            with anyio.CancelScope(shield=True):
                if proc.returncode is None:
                    proc.terminate()
                    with anyio.move_on_after(self.stop_grace_s):
                        await proc.wait()
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()
