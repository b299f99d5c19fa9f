"""The eBPF L4 load balancer (examples/ebpf) against real replicas: ``make test-ebpf``
(root; not part of ``make test``: tests/conftest.py collects this folder only when
``EPICK_TEST_EBPF`` is set). Missing tools fail; a kernel that refuses the program skips
every test with the kernel's reason.

Everything a test makes is its own and removed after: a cgroup v2 directory (the program
attaches there, so only the test's client processes are balanced), a bpffs mount (the
agent pins its maps there), the agent process, the replicas and epick. No interface,
route or address of the machine is touched: connect4 rewrites the destination inside
connect(); the virtual addresses are TEST-NET-1 (192.0.2.0/24) and never carry a packet.

Fixtures:
    lb_object          the built lb.bpf.o (loaded once as a probe; skip if it cannot be)
    cgroup             a fresh cgroup v2 directory, removed after
    bpffs              a fresh bpffs mount, unmounted after
    agent(target, vips)   examples/ebpf/agent.py on the venv's python, attached to
                       ``cgroup``, maps pinned in ``bpffs``; stopped (SIGTERM) after
    sim_fleet          three simulated vLLM replicas (``python -m epick.sim serve``)
    connect_many(vip, n)  n new TCP connections from a process in ``cgroup``: which
                       replica answered each (its x-served-by), or the connect() error
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from ebpf_results import RESULTS

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ebpf"
OBJECT = EXAMPLE / "lb.bpf.o"
sys.path.insert(0, str(EXAMPLE))
sys.path.insert(0, str(REPO / "tests" / "envoy"))
from agent import Balancer, BpfError  # noqa: E402
from replica import replicas_fixture  # noqa: E402, F401  (the Envoy tests' replicas)
from sim_fleet import sim_fleet as start_sim_fleet  # noqa: E402


def pytest_terminal_summary(terminalreporter) -> None:
    if RESULTS:
        terminalreporter.section("tests/ebpf results")
        for line in RESULTS:
            terminalreporter.write_line(line)


def _mounts() -> list[tuple[str, str]]:
    with open("/proc/self/mounts") as f:
        return [(line.split()[1], line.split()[2]) for line in f]


@pytest.fixture(scope="session")
def lb_object() -> Path:
    if os.geteuid() != 0:
        pytest.skip("tests/ebpf load an eBPF program: they need root")
    if not OBJECT.exists():
        subprocess.run(["make", "-s", "-C", str(EXAMPLE)], check=True)
    try:
        Balancer(OBJECT).close()
    except BpfError as exc:
        pytest.skip(f"eBPF cannot load here: {exc}")
    return OBJECT


@pytest.fixture(scope="session", autouse=True)
def interfaces_untouched() -> Iterator[None]:
    before = sorted(os.listdir("/sys/class/net"))
    yield
    assert sorted(os.listdir("/sys/class/net")) == before


@pytest.fixture
def cgroup(tmp_path, lb_object) -> Iterator[str]:
    roots = [m for m, fs in _mounts() if fs == "cgroup2"]
    mounted = None
    if not roots:  # a cgroup v1 machine: mount the v2 hierarchy for ourselves
        mounted = tmp_path / "cgroup2"
        mounted.mkdir()
        subprocess.run(["mount", "-t", "cgroup2", "none", str(mounted)], check=True)
        roots = [str(mounted)]
    path = Path(roots[0]) / f"epick-ebpf-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield str(path)
    finally:
        # Any straggler goes back to the root first (a cgroup with members cannot go).
        for pid in (path / "cgroup.procs").read_text().split():
            try:
                (Path(roots[0]) / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        path.rmdir()
        if mounted is not None:
            subprocess.run(["umount", str(mounted)], check=True)


@pytest.fixture
def bpffs(tmp_path, lb_object) -> Iterator[str]:
    path = tmp_path / "bpffs"
    path.mkdir()
    subprocess.run(["mount", "-t", "bpf", "bpf", str(path)], check=True)
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", str(path)], check=True)


class Agent:
    """examples/ebpf/agent.py as a process; its JSON lines in a queue."""

    def __init__(self, target: str, vips: list[str], cgroup: str, pin: str) -> None:
        cmd = [sys.executable, str(EXAMPLE / "agent.py"), "--epick", target,
               "--cgroup", cgroup, "--object", str(OBJECT), "--pin", pin]
        for v in vips:
            cmd += ["--vip", v]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.events: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put(None)

    def until(self, predicate, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no such agent event in {timeout} s; saw "
                                     f"{self.seen[-5:]}") from None
            if event is None:
                raise AssertionError(f"the agent exited: {self.proc.wait()} "
                                     f"{self.proc.stderr.read()}")
            self.seen.append(event)
            if predicate(event):
                return event

    def table(self, vip: str, pred=lambda e: True, timeout: float = 10.0) -> dict:
        """``vip``'s applied table once it satisfies ``pred``: the latest one already
        read if it does (the agent writes each address's first table in any order),
        else the next one that does."""
        last = next((e for e in reversed(self.seen)
                     if e["event"] == "applied" and e["vip"] == vip), None)
        if last is not None and pred(last):
            return last
        return self.until(lambda e: e["event"] == "applied" and e["vip"] == vip
                          and pred(e), timeout)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=10)
        finally:
            self.proc.stderr.close()


@pytest.fixture
def agent(cgroup, bpffs) -> Iterator:
    started: list[Agent] = []

    def start(target: str, vips: list[str]) -> Agent:
        a = Agent(target, vips, cgroup, bpffs)
        started.append(a)
        a.until(lambda e: e["event"] == "ready")
        return a

    yield start
    for a in started:
        assert a.stop() == 0


CLIENT = r"""
import errno, json, socket, sys
cgroup, ip, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with open(cgroup + "/cgroup.procs", "w") as f:
    f.write("0")  # this process joins the balanced cgroup
counts = {}
for _ in range(n):
    s = socket.socket()
    s.settimeout(10)
    try:
        s.connect((ip, port))
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: vip\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        head = data.split(b"\r\n\r\n")[0].decode()
        served = [h.split(":", 1)[1].strip() for h in head.split("\r\n")
                  if h.lower().startswith("x-served-by:")]
        # The replica's own word where it gives one (tests/envoy/replica.py), else the
        # address the socket is connected to (the simulated fleet names no one).
        key = served[0] if served else "%s:%d" % s.getpeername()
    except OSError as exc:
        key = "error " + errno.errorcode.get(exc.errno, str(exc))
    finally:
        s.close()
    counts[key] = counts.get(key, 0) + 1
print(json.dumps(counts))
"""


@pytest.fixture
def connect_many(cgroup):
    def run(vip: str, n: int) -> Counter:
        ip, _, port = vip.partition(",")[0].rpartition(":")
        out = subprocess.run([sys.executable, "-c", CLIENT, cgroup, ip, port, str(n)],
                             capture_output=True, text=True, timeout=120, check=True)
        return Counter(json.loads(out.stdout))
    return run


@pytest.fixture
def sim_fleet() -> Iterator[list[str]]:
    """Three simulated replicas (real-time driver, 4 adapters, 1 LoRA slot each) in a
    child process, as tests/envoy/test_envoy_sim.py starts them; their addresses."""
    with start_sim_fleet(3, adapters=4, max_lora=1) as addresses:
        yield addresses
