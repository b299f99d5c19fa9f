"""The userspace half of epick's eBPF load balancer (docs/dataplanes.md, "L4").

Loads ``lb.bpf.o`` (the cgroup/connect4 program, lb.bpf.c) with libbpf through ctypes,
attaches it to a cgroup v2 directory, subscribes to epick's ``WatchWeights`` once per
virtual address and rewrites that address's slot table in the kernel on every table::

    .venv/bin/python examples/ebpf/agent.py --epick 127.0.0.1:9002 \\
        --cgroup /sys/fs/cgroup/unified/llm-clients \\
        --vip 192.0.2.10:8000,model=base \\
        --vip 192.0.2.10:8001,model=base,adapter=sql-lora

A process in that cgroup that connects to 192.0.2.10:8000 reaches a replica drawn by the
base model's weights; :8001 by the adapter's. Nothing else is touched: no interface, no
route, no packet rewrite (the address is swapped inside connect(), before a packet exists).

Weights -> slots: each table's weights become ``SLOTS`` (1024) slots by largest
remainder; endpoints at weight 0 get none; a table with no eligible endpoint empties the
table (connects to that address fail with EPERM). The agent writes the table not in use
and flips ``active`` in one map update: a connect() never sees half a table. If the
stream breaks, the kernel keeps the last table (fail static) and the agent reconnects.

Runs from the repo's venv (``grpc`` and epick's generated protos); needs root (or
CAP_BPF + CAP_NET_ADMIN) and Debian's ``libbpf1``. ``--pin DIR`` (a bpffs directory) pins
the maps there too, for ``bpftool map dump pinned DIR/slots``; they are unpinned at exit.
One JSON line per event on stdout: ``ready``, ``applied`` (per table written, with the
slot counts and ``applied_at``, the wall-clock time the flip returned), ``stream-error``,
``apply-error``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from epick.api.gen.epick.v1 import picker_pb2, picker_pb2_grpc

#: As lb.bpf.c: slots per table, virtual addresses per program.
SLOTS = 1024
MAX_VIPS = 64
HERE = Path(__file__).resolve().parent
DEFAULT_OBJECT = HERE / "lb.bpf.o"
PROGRAM = "epick_connect4"


class BpfError(OSError):
    pass


def _libbpf() -> ctypes.CDLL:
    name = ctypes.util.find_library("bpf") or "libbpf.so.1"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise BpfError(errno.ENOENT, f"libbpf not found ({name}): apt-get install libbpf1"
                       ) from exc
    p, i, u32p = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint32)
    for fn, res, args in [
        ("bpf_object__open_file", p, [ctypes.c_char_p, p]),
        ("bpf_object__load", i, [p]),
        ("bpf_object__close", None, [p]),
        ("bpf_object__find_program_by_name", p, [p, ctypes.c_char_p]),
        ("bpf_object__find_map_fd_by_name", i, [p, ctypes.c_char_p]),
        ("bpf_object__pin_maps", i, [p, ctypes.c_char_p]),
        ("bpf_object__unpin_maps", i, [p, ctypes.c_char_p]),
        ("bpf_program__attach_cgroup", p, [p, i]),
        ("bpf_link__destroy", i, [p]),
        ("bpf_map_update_elem", i, [i, p, p, ctypes.c_uint64]),
        ("bpf_map_lookup_elem", i, [i, p, p]),
        ("bpf_map_update_batch", i, [i, p, p, u32p, p]),
    ]:
        f = getattr(lib, fn)
        f.restype, f.argtypes = res, args
    return lib


def _check(what: str, result):
    """libbpf 1.x: NULL (with errno) or a negative errno is a failure."""
    if result is None or (isinstance(result, int) and result < 0):
        err = ctypes.get_errno() if result is None or result == -1 else -result
        raise BpfError(err, f"{what}: {os.strerror(err)}")
    return result


def _addr(ip: str, port: int) -> bytes:
    """struct vip_key / struct backend: IPv4 and port in network byte order, 2 pad bytes."""
    return socket.inet_aton(ip) + struct.pack("!H", port) + b"\0\0"


def resolve(endpoint: str) -> tuple[str, int] | None:
    """``host:port`` -> an IPv4 address and port (None for IPv6: connect4 is IPv4 only)."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, ValueError):
        return None
    return (infos[0][4][0], int(port)) if infos else None


def slot_counts(weights: dict[str, float], slots: int = SLOTS) -> dict[str, int]:
    """Weights -> slots by largest remainder (Hamilton): the counts sum to ``slots``
    (0 when no weight is positive) and each is within one slot of weight × slots."""
    positive = {e: w for e, w in weights.items() if w > 0}
    total = sum(positive.values())
    if total <= 0:
        return {}
    exact = {e: w / total * slots for e, w in positive.items()}
    counts = {e: int(x) for e, x in exact.items()}
    left = slots - sum(counts.values())
    for e in sorted(exact, key=lambda e: (counts[e] - exact[e], e))[:left]:
        counts[e] += 1
    return {e: n for e, n in counts.items() if n > 0}


@dataclass
class Vip:
    ip: str
    port: int
    model: str
    adapter: str = ""
    criticality: str = ""

    @classmethod
    def parse(cls, spec: str) -> Vip:
        """``ADDR:PORT,model=M[,adapter=A][,criticality=C]``."""
        head, *opts = spec.split(",")
        ip, _, port = head.rpartition(":")
        kw = {}
        for opt in opts:
            k, sep, v = opt.partition("=")
            if not sep or k not in ("model", "adapter", "criticality"):
                raise ValueError(f"--vip {spec!r}: {opt!r} is not model=, adapter= or "
                                 "criticality=")
            kw[k] = v
        if "model" not in kw:
            raise ValueError(f"--vip {spec!r}: model= is required")
        try:
            socket.inet_aton(ip)
            return cls(ip, int(port), **kw)
        except (OSError, ValueError):
            raise ValueError(f"--vip {spec!r}: not ADDR:PORT with an IPv4 address") from None

    @property
    def name(self) -> str:
        return f"{self.ip}:{self.port}"


class Balancer:
    """The loaded program and its maps: :meth:`attach` to a cgroup, :meth:`add_vip`,
    :meth:`write` a slot table. Close it to detach (the link goes with the process too)."""

    def __init__(self, obj_path: Path = DEFAULT_OBJECT, *, pin: str | None = None) -> None:
        self.lib = _libbpf()
        self.obj = _check(f"open {obj_path}",
                          self.lib.bpf_object__open_file(str(obj_path).encode(), None))
        self._links: list[int] = []
        self._pin = pin
        self._pinned = False
        self._active: dict[int, int] = {}
        self._lock = threading.Lock()
        try:
            _check(f"load {obj_path}", self.lib.bpf_object__load(self.obj))
            self.vips_fd = self._map("vips")
            self.slots_fd = self._map("slots")
            self.stats_fd = self._map("stats")
            if pin:
                _check(f"pin maps in {pin}", self.lib.bpf_object__pin_maps(
                    self.obj, pin.encode()))
                self._pinned = True
        except BaseException:
            self.close()
            raise

    def _map(self, name: str) -> int:
        return _check(f"map {name}", self.lib.bpf_object__find_map_fd_by_name(
            self.obj, name.encode()))

    def attach(self, cgroup: str) -> None:
        prog = _check(PROGRAM, self.lib.bpf_object__find_program_by_name(
            self.obj, PROGRAM.encode()))
        fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
        try:
            link = _check(f"attach to cgroup {cgroup}",
                          self.lib.bpf_program__attach_cgroup(prog, fd))
        finally:
            os.close(fd)
        self._links.append(link)

    def add_vip(self, index: int, vip: Vip) -> None:
        """Register ``vip`` with an empty table (connects to it are refused until the
        first table)."""
        if not 0 <= index < MAX_VIPS:
            raise ValueError(f"at most {MAX_VIPS} virtual addresses")
        self._fill(index, 0, [])
        self._active[index] = 0
        self._set_vip(vip, index, 0)

    def write(self, index: int, vip: Vip, backends: list[tuple[str, int]]) -> None:
        """Make ``backends`` (SLOTS entries, or [] for none) ``vip``'s table: fill the
        half not in use, then flip."""
        with self._lock:
            half = 1 - self._active[index]
            self._fill(index, half, backends)
            self._set_vip(vip, index, half)
            self._active[index] = half

    def _set_vip(self, vip: Vip, index: int, active: int) -> None:
        key = ctypes.create_string_buffer(_addr(vip.ip, vip.port), 8)
        val = ctypes.create_string_buffer(struct.pack("=II", index, active), 8)
        _check("update vips", self.lib.bpf_map_update_elem(self.vips_fd, key, val, 0))

    def _fill(self, index: int, half: int, backends: list[tuple[str, int]]) -> None:
        if backends and len(backends) != SLOTS:
            raise ValueError(f"a table has {SLOTS} slots, got {len(backends)}")
        base = (index * 2 + half) * SLOTS
        keys = (ctypes.c_uint32 * SLOTS)(*range(base, base + SLOTS))
        raw = b"".join(_addr(ip, port) for ip, port in backends) or bytes(8 * SLOTS)
        values = ctypes.create_string_buffer(raw, len(raw))
        count = ctypes.c_uint32(SLOTS)
        # One syscall for the table (BPF_MAP_UPDATE_BATCH, arrays since 5.6).
        _check("update slots", self.lib.bpf_map_update_batch(
            self.slots_fd, keys, values, ctypes.byref(count), None))

    def close(self) -> None:
        for link in self._links:
            self.lib.bpf_link__destroy(link)
        self._links.clear()
        if self.obj:
            if self._pinned:
                self.lib.bpf_object__unpin_maps(self.obj, self._pin.encode())
            self.lib.bpf_object__close(self.obj)
            self.obj = None


_EMIT = threading.Lock()


def emit(event: str, **fields) -> None:
    """One JSON line on stdout (one writer at a time: followers run on their threads)."""
    line = json.dumps({"event": event, **fields}) + "\n"
    with _EMIT:
        sys.stdout.write(line)
        sys.stdout.flush()


class Follower:
    """One virtual address: WatchWeights -> :meth:`Balancer.write`, reconnecting with
    backoff when the stream breaks (the kernel keeps the last table meanwhile)."""

    def __init__(self, balancer: Balancer, index: int, vip: Vip, target: str) -> None:
        self.balancer, self.index, self.vip, self.target = balancer, index, vip, target
        self._stop = threading.Event()
        self._call = None
        self.thread = threading.Thread(target=self._run, name=f"follow {vip.name}",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        self.thread.join(timeout=5)

    def _request(self) -> picker_pb2.WeightsRequest:
        req = picker_pb2.WeightsRequest(model=self.vip.model, adapter=self.vip.adapter)
        if self.vip.criticality:
            req.criticality = picker_pb2.Criticality.Value(self.vip.criticality)
        return req

    def _run(self) -> None:
        backoff = 0.1
        with grpc.insecure_channel(self.target) as channel:
            stub = picker_pb2_grpc.EndpointPickerStub(channel)
            while not self._stop.is_set():
                try:
                    self._call = stub.WatchWeights(self._request())
                    for table in self._call:
                        try:
                            self.apply(table)
                        except BpfError as exc:  # the kernel keeps the last table
                            emit("apply-error", vip=self.vip.name, message=str(exc))
                        backoff = 0.1
                except grpc.RpcError as exc:
                    if self._stop.is_set():
                        return
                    emit("stream-error", vip=self.vip.name, code=exc.code().name,
                         message=exc.details())
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)

    def apply(self, table: picker_pb2.WeightsTable) -> None:
        received_at = time.time()
        addrs = {e.endpoint: resolve(e.endpoint) for e in table.endpoints}
        counts = slot_counts({e.endpoint: e.weight for e in table.endpoints
                              if addrs[e.endpoint] is not None})
        backends = [addrs[ep] for ep, n in sorted(counts.items()) for _ in range(n)]
        self.balancer.write(self.index, self.vip, backends)
        emit("applied", vip=self.vip.name, snapshot_version=table.snapshot_version,
             timestamp_ms=table.timestamp_ms, received_at=received_at,
             applied_at=time.time(), slots=counts, reason=table.reason)


def _vip_arg(spec: str) -> Vip:
    try:
        return Vip.parse(spec)
    except (ValueError, OSError) as exc:  # OSError: inet_aton on a bad address
        raise argparse.ArgumentTypeError(str(exc) or f"bad --vip {spec!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epick", required=True, help="epick's gRPC address (host:port)")
    ap.add_argument("--cgroup", required=True, help="cgroup v2 directory to attach to")
    ap.add_argument("--vip", action="append", required=True, type=_vip_arg,
                    help="ADDR:PORT,model=M[,adapter=A][,criticality=C] (repeatable)")
    ap.add_argument("--object", type=Path, default=DEFAULT_OBJECT,
                    help="the built program (make -C examples/ebpf)")
    ap.add_argument("--pin", help="a bpffs directory to pin the maps in")
    args = ap.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        balancer = Balancer(args.object, pin=args.pin)
    except BpfError as exc:
        print(f"agent: {exc}", file=sys.stderr)
        return 2
    followers = []
    try:
        for i, vip in enumerate(args.vip):
            balancer.add_vip(i, vip)
        balancer.attach(args.cgroup)
        emit("ready", vips=[v.name for v in args.vip], cgroup=args.cgroup, pid=os.getpid())
        followers = [Follower(balancer, i, vip, args.epick) for i, vip in enumerate(args.vip)]
        for f in followers:
            f.start()
        stop.wait()
    except BpfError as exc:
        print(f"agent: {exc}", file=sys.stderr)
        return 2
    finally:
        for f in followers:
            f.stop()
        balancer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
