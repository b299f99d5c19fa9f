"""Run the committed NGINX and HAProxy examples (``examples/nginx``, ``examples/haproxy``)
on free ports, for the data-plane tests (tests/dataplanes) and the benchmark.

Like :mod:`epick.bench.envoy`: the example folder is copied to a temporary folder and only
its addresses are rewritten (:func:`render`), so what the tests prove holds for the files
operators copy. The binaries are Debian's (``make test-dataplanes`` installs them).

    with Proxy("nginx", epick_http_port=9005, replicas=[...]) as proxy:
        httpx.post(f"{proxy.url}/v1/completions", json=...)
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["KINDS", "ProxyError", "find", "render", "Proxy", "free_port"]

REPO = Path(__file__).resolve().parents[2]
#: Proxy kind -> (example folder, config file name, the address it listens on there).
KINDS = {
    "nginx": (REPO / "examples" / "nginx", "nginx.conf", "127.0.0.1:8081"),
    "haproxy": (REPO / "examples" / "haproxy", "haproxy.cfg", "127.0.0.1:8082"),
}
#: What each kind needs on the machine (Debian packages in parentheses).
BINARIES = {
    "nginx": (("nginx", "nginx"),
              ("/usr/lib/nginx/modules/ngx_http_js_module.so", "libnginx-mod-http-js")),
    "haproxy": (("haproxy", "haproxy"),),
}
EPICK_HTTP = "127.0.0.1:9005"


class ProxyError(RuntimeError):
    """A binary is missing, the proxy would not start, or an example line moved."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find(kind: str) -> Path:
    """The proxy's executable; :class:`ProxyError` names what is missing and how to get it."""
    found = []
    for name, package in BINARIES[kind]:
        if name.startswith("/"):  # a file (a module), not a command
            path = name if Path(name).is_file() else None
        else:
            path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
        if path is None:
            raise ProxyError(f"{kind}: {name} not found: run `make test-dataplanes` (it "
                             f"apt-get installs {package}) or `apt-get install {package}`")
        found.append(Path(path))
    return found[0]


def _replace(text: str, old: str, new: str, *, count: int = 1) -> str:
    if text.count(old) != count:
        raise ProxyError(f"the example must contain {old!r} {count} time(s) "
                         f"(found {text.count(old)})")
    return text.replace(old, new)


def render(kind: str, text: str, *, listen_port: int, epick_http_port: int,
           replicas: list[str], fail_open: bool = False, epick: bool = True) -> str:
    """The example config with its addresses replaced; ``replicas`` fill the fail-open
    round-robin group; ``fail_open`` lets requests through when epick is unreachable;
    ``epick=False`` sends every request round robin to ``replicas`` without asking epick
    (the benchmark's baseline: the same proxy, no routing call)."""
    _folder, _name, listen = KINDS[kind]
    directive = "listen " if kind == "nginx" else "bind "
    text = _replace(text, directive + listen, f"{directive}127.0.0.1:{listen_port}")
    if EPICK_HTTP not in text:
        raise ProxyError(f"the {kind} example must name epick's address {EPICK_HTTP}")
    text = text.replace(EPICK_HTTP, f"127.0.0.1:{epick_http_port}")
    if kind == "nginx":
        servers = "".join(f"        server {r};\n" for r in replicas)
        text, n = re.subn(r"(    upstream replicas \{\n)(?:        server .*;\n)+",
                          lambda m: m.group(1) + servers, text)
        if fail_open:
            text = _replace(text, 'js_var $epick_failure_mode "closed";',
                            'js_var $epick_failure_mode "open";')
    else:
        servers = "".join(f"    server r{i} {r}\n" for i, r in enumerate(replicas, 1))
        text, n = re.subn(r"(backend replicas\n    balance roundrobin\n)(?:    server .*\n)+",
                          lambda m: m.group(1) + servers, text)
        if fail_open:
            text = _replace(text, "setenv EPICK_FAILURE_MODE closed",
                            "setenv EPICK_FAILURE_MODE open")
    if n != 1:
        raise ProxyError(f"the {kind} example has no `replicas` group to fill")
    if not epick:
        if kind == "nginx":
            text = _replace(text, "            js_content epick.route;\n",
                            "            proxy_pass http://replicas;\n")
        else:
            text = _replace(text, "    http-request lua.epick_route\n", "")
            text = _replace(text, "default_backend epick_endpoint", "default_backend replicas")
    return text


class Proxy:
    """One running proxy from its rendered example (in a temporary copy of its folder)."""

    def __init__(self, kind: str, *, epick_http_port: int, replicas: list[str],
                 fail_open: bool = False, listen_port: int = 0, epick: bool = True,
                 folder: Path | None = None) -> None:
        self.kind = kind
        self.port = listen_port or free_port()
        example, name, _listen = KINDS[kind]
        folder = folder or example  # another copy of the example (the benchmark's --before)
        self._tmp = tempfile.TemporaryDirectory(prefix=f"epick-{kind}-")
        self.folder = Path(self._tmp.name)
        shutil.copytree(folder, self.folder, dirs_exist_ok=True)
        config = self.folder / name
        config.write_text(render(kind, (folder / name).read_text(), listen_port=self.port,
                                 epick_http_port=epick_http_port, replicas=replicas,
                                 fail_open=fail_open, epick=epick))
        binary = find(kind)
        self.argv = ([str(binary), "-p", str(self.folder), "-c", name] if kind == "nginx"
                     else [str(binary), "-f", name])
        self._log = self.folder / "proxy.log"
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def start(self, timeout_s: float = 10.0) -> Proxy:
        with self._log.open("wb") as out:
            self._proc = subprocess.Popen(self.argv, cwd=self.folder, stdout=out,
                                          stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ProxyError(f"{self.kind} exited with {self._proc.returncode}:\n{self.log}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise ProxyError(f"{self.kind} did not listen on {self.port} in {timeout_s} s:\n"
                         f"{self.log}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._tmp.cleanup()

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
