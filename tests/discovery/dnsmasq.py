"""A real DNS server for the discovery tests: Debian's dnsmasq on a free loopback port.

    with Dnsmasq(tmp_path, hosts={"fleet.test": ["127.0.0.2"]}) as dns:
        dns.resolver                      # "127.0.0.1:PORT" for [[pool.sources]] resolver
        dns.set_hosts({...}); dns.reload()  # rewrite its hosts file, SIGHUP: re-read

Answers for the names in its hosts file (``--addn-hosts``, re-read on SIGHUP) with TTL
``local_ttl``, SRV records given at start (``--srv-host``; SIGHUP does not re-read those),
and NXDOMAIN for any other name under ``.test`` (``--local``). It runs as root without
dropping privileges (so it can re-read a file under pytest's 0700 tmp folder), reads no
system config, and is stopped by its PID. Missing dnsmasq is an error, never a skip:
`make test` installs it (Makefile, ``dnsmasq`` step).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import dns.resolver

__all__ = ["Dnsmasq", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port free for both UDP and TCP on ``host`` (dnsmasq binds both)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind((host, 0))
            port = udp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                try:
                    tcp.bind((host, port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free UDP+TCP port on " + host)


class Dnsmasq:
    def __init__(self, folder: Path, *, hosts: dict[str, list[str]],
                 srv: list[tuple[str, str, int]] = (), local_ttl: int = 1) -> None:
        binary = shutil.which("dnsmasq") or next(
            (p for p in ("/usr/sbin/dnsmasq", "/sbin/dnsmasq") if Path(p).exists()), None)
        if binary is None:
            raise RuntimeError("dnsmasq is not installed: run `make test` (it installs it) "
                               "or `apt-get install -y dnsmasq`")
        self.binary = binary
        self.hosts_file = folder / "dnsmasq.hosts"
        self.log_file = folder / "dnsmasq.log"
        self.srv = list(srv)
        self.local_ttl = local_ttl
        self.set_hosts(hosts)
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def resolver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_hosts(self, hosts: dict[str, list[str]]) -> None:
        lines = [f"{ip} {name}" for name, ips in hosts.items() for ip in ips]
        tmp = self.hosts_file.with_suffix(".new")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.hosts_file)

    def start(self) -> Dnsmasq:
        self.port = self.port or free_port()
        args = [self.binary, "--no-daemon", "--conf-file=/dev/null", f"--port={self.port}",
                "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv",
                "--no-hosts", f"--addn-hosts={self.hosts_file}", "--local=/test/",
                f"--local-ttl={self.local_ttl}", "--user=root", "--group=root",
                "--pid-file=", "--cache-size=0"]
        args += [f"--srv-host={name},{target},{port}" for name, target, port in self.srv]
        self.proc = subprocess.Popen(args, stdout=self.log_file.open("ab"),
                                     stderr=subprocess.STDOUT)
        self._wait_answering()
        return self

    def _wait_answering(self, timeout: float = 10.0) -> None:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers, resolver.port, resolver.lifetime = ["127.0.0.1"], self.port, 0.2
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dnsmasq exited ({self.proc.returncode}): "
                                   f"{self.log_file.read_text()[-2000:]}")
            try:
                resolver.resolve("probe.test", "A")
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError("dnsmasq did not answer within 10 s") from None
                time.sleep(0.05)
            else:
                return

    def reload(self) -> None:
        """SIGHUP: dnsmasq re-reads its hosts file (and clears its cache)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # by its PID (Popen holds it)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> Dnsmasq:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
