"""`epick bench http`: ``POST /v1/pick`` beside unary gRPC ``Pick``, same service, one run.

One ``epick serve`` (8 endpoints scraped every 50 ms from :mod:`epick.bench.pages`, the
three built-in policies) with both the gRPC API and ``[http] listen`` on. Rounds alternate
the four phases, so a slow moment of the machine lands on both sides alike:

    seq   one client: gRPC Pick, then POST /v1/pick            (p50 / p99 latency)
    par   ``--threads`` clients: gRPC Pick, then POST /v1/pick  (calls/s)

The clients are synchronous threads (gRPC: a channel each; HTTP: one keep-alive
socket each, a request in one write as a proxy sends it) sending the same seeded requests — the HTTP ones as
protobuf's JSON mapping. Issue 25's targets: /v1/pick p50 <= gRPC's at one client, and
calls/s >= gRPC's at 8 clients.

``--servers`` measures the candidate HTTP servers instead (docs/dataplanes.md: the choice
by measurement): each in a process of its own answering a fixed JSON body, one client.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from google.protobuf import json_format

from epick.bench.dataplanes import free_port
from epick.bench.grpc import Phase, Setup, requests, run_clients, unary_phase

__all__ = ["main", "measure", "http_phase", "run_aiohttp"]


class HttpSetup(Setup):
    """:class:`epick.bench.grpc.Setup` with the HTTP front end on too."""

    def __init__(self, *a, http_port: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.http_port = http_port

    def config(self, pages_port: int) -> str:
        return super().config(pages_port) + f'[http]\nlisten = "127.0.0.1:{self.http_port}"\n'


def http_phase(port: int, threads: int, seconds: float, bodies: list[bytes],
               path: str = "/v1/pick") -> list[float]:
    """``threads`` keep-alive clients POSTing ``bodies`` for ``seconds``; µs each.

    Each client is a bare socket writing a request in one ``send`` (as a proxy does) and
    reading the answer by its Content-Length: http.client writes headers and body
    separately and parses headers in Python, which measured 3-5 ms a call here — the
    client, not the server."""
    stop = time.perf_counter() + seconds
    raws = [(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
             f"\r\nContent-Length: {len(b)}\r\n\r\n").encode() + b for b in bodies]

    def connect() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def client(k: int, lat: list[float]) -> None:
        sock = connect()
        i, perf = k, time.perf_counter
        try:
            while True:
                t0 = perf()
                try:
                    sock.sendall(raws[i % len(raws)])
                    status, body = _read_response(sock)
                except (ConnectionError, _Closed):
                    # A server ends keep-alive after so many requests (NGINX: 1,000):
                    # reconnect, and time the request again from there.
                    sock.close()
                    sock = connect()
                    t0 = perf()
                    sock.sendall(raws[i % len(raws)])
                    status, body = _read_response(sock)
                lat.append((perf() - t0) * 1e6)
                if status != 200:
                    raise RuntimeError(f"{status} {body[:200]!r}")
                i += threads
                if perf() >= stop:
                    break
        finally:
            sock.close()

    return run_clients(threads, client, f"POST {path}")


class _Closed(Exception):
    """The server closed the connection before answering."""


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One answer: its status and body (by Content-Length, or chunked: Envoy streams a
    body that passed through ext_proc that way)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise _Closed
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length, chunked = 0, False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    reader = _Reader(sock, rest)
    if not chunked:
        return int(lines[0].split()[1]), reader.take(length)
    parts = []
    while True:
        size = int(reader.line().split(b";")[0], 16)
        if size == 0:
            while reader.line():  # trailers, then the empty line
                pass
            return int(lines[0].split()[1]), b"".join(parts)
        parts.append(reader.take(size))
        reader.line()


class _Reader:
    """Exact reads from a socket, after what was already received."""

    def __init__(self, sock: socket.socket, buf: bytes) -> None:
        self.sock, self.buf = sock, buf

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise RuntimeError("the server closed the connection mid-answer")
        self.buf += chunk

    def take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        out, _, self.buf = self.buf.partition(b"\r\n")
        return out


def measure(*, threads: int = 8, seconds: float = 4.0, rounds: int = 4,
            endpoints: int = 8, settle_s: float = 0.5) -> dict[str, Phase]:
    """Every phase, ``seconds`` each over all rounds: {"seq_grpc", "seq_http", "par_grpc",
    "par_http"} -> :class:`Phase`."""
    setup = HttpSetup(f"{endpoints} endpoints", endpoints, 50, http_port=free_port())
    reqs = requests(4096)
    bodies = [json_format.MessageToJson(r, indent=None).encode() for r in reqs]
    pages = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "epick.bench.pages",
                              "--count", str(endpoints)], stdout=subprocess.PIPE, text=True)
    phases: dict[str, Phase] = {}
    try:
        pages_port = int(pages.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "epick.toml"
            path.write_text(setup.config(pages_port))
            setup.start(path)
            unary_phase(setup.target, "pick", 1, 0.2, reqs)  # warm both, check they answer
            http_phase(setup.http_port, 1, 0.2, bodies)
            time.sleep(settle_s)
            per = seconds / rounds
            for _ in range(rounds):
                for mode, n in (("seq", 1), ("par", threads)):
                    for kind in ("grpc", "http"):
                        t0 = time.perf_counter()
                        lat = (unary_phase(setup.target, "pick", n, per, reqs) if kind == "grpc"
                               else http_phase(setup.http_port, n, per, bodies))
                        phases.setdefault(f"{mode}_{kind}", Phase()).record(
                            lat, time.perf_counter() - t0)
    finally:
        try:
            setup.stop()
        finally:
            pages.terminate()
            pages.wait(timeout=10)
    return phases


# -- the server candidates (--servers) ------------------------------------------------

ANSWER = json.dumps({"endpoint": "10.0.0.1:8000", "fallbacks": ["10.0.0.2:8000"],
                     "decisionId": "0123abcd-1"}).encode()


def _serve_aiohttp_app() -> None:
    from aiohttp import web

    async def pick(request):
        await request.read()
        return web.Response(body=ANSWER, headers={"Content-Type": "application/json"})

    app = web.Application()
    app.router.add_post("/v1/pick", pick)
    run_aiohttp(lambda: web.AppRunner(app, access_log=None))


def _serve_aiohttp_lowlevel() -> None:
    from aiohttp import web

    async def pick(request):
        await request.read()
        return web.Response(body=ANSWER, headers={"Content-Type": "application/json"})

    run_aiohttp(lambda: web.ServerRunner(web.Server(pick, access_log=None)))


def run_aiohttp(make_runner) -> None:
    import asyncio

    from aiohttp import web

    async def main() -> None:
        runner = make_runner()  # (web.Server wants the running loop)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        print(site._server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def _serve_asyncio_raw() -> None:
    """The floor: an asyncio Protocol that parses only what this client sends (no chunked
    bodies, no pipelining checks) — what any real server costs at least."""
    import asyncio

    head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(ANSWER)).encode() + b"\r\n\r\n" + ANSWER)

    class Proto(asyncio.Protocol):
        def connection_made(self, transport):
            self.t, self.buf = transport, b""

        def data_received(self, data):
            self.buf += data
            while True:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                length = 0
                for line in self.buf[:end].split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if len(self.buf) < end + 4 + length:
                    return
                self.buf = self.buf[end + 4 + length:]
                self.t.write(head)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Proto, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


SERVERS = {"aiohttp (web.Application)": _serve_aiohttp_app,
           "aiohttp (low-level web.Server)": _serve_aiohttp_lowlevel,
           "asyncio Protocol, hand parser (floor)": _serve_asyncio_raw}


def measure_servers(*, seconds: float = 2.0, threads: int = 8) -> dict[str, dict[str, Phase]]:
    body = [json.dumps({"model": "llama", "prompt": "hi"}).encode()]
    out = {}
    for name in SERVERS:
        proc = subprocess.Popen([sys.executable, "-m", "epick.bench.http", "--serve", name],
                                stdout=subprocess.PIPE, text=True)
        try:
            port = int(proc.stdout.readline())
            http_phase(port, 1, 0.2, body)
            out[name] = {}
            for mode, n in (("seq", 1), ("par", threads)):
                t0 = time.perf_counter()
                lat = http_phase(port, n, seconds, body)
                out[name][mode] = ph = Phase()
                ph.record(lat, time.perf_counter() - t0)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick bench http", description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="per phase, over all rounds")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=8, help="clients of the par phase")
    ap.add_argument("--servers", action="store_true",
                    help="measure the candidate HTTP servers instead")
    ap.add_argument("--proxies", action="store_true",
                    help="the latency NGINX and HAProxy add with epick vs round robin "
                         "(`epick bench dataplanes --only nginx,haproxy`)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args(argv)
    if args.serve:
        SERVERS[args.serve]()
        return 0
    if args.proxies:  # the older home of `epick bench dataplanes` (NGINX and HAProxy)
        from epick.bench import proxies

        return proxies.main(["--seconds", str(args.seconds), "--rounds", str(args.rounds),
                             "--clients", f"1,{args.threads}", "--only", "nginx,haproxy",
                             *(["--json", str(args.json)] if args.json else [])])
    if args.servers:
        res = measure_servers(seconds=args.seconds, threads=args.threads)
        print(f"{'server':40} {'p50 µs (1 client)':>18} {'p99 µs':>8} "
              f"{'calls/s (' + str(args.threads) + ' clients)':>22}")
        for name, ph in res.items():
            print(f"{name:40} {ph['seq'].p50:18.0f} {ph['seq'].p99:8.0f} {ph['par'].rate:22.0f}")
        doc = {n: {"p50_us": p["seq"].p50, "p99_us": p["seq"].p99, "calls_per_s": p["par"].rate}
               for n, p in res.items()}
    else:
        ph = measure(threads=args.threads, seconds=args.seconds, rounds=args.rounds)
        print(f"{'':22} {'p50 µs (1 client)':>18} {'p99 µs':>8} "
              f"{'calls/s (' + str(args.threads) + ' clients)':>22}")
        for kind, label in (("grpc", "gRPC unary Pick"), ("http", "POST /v1/pick")):
            seq, par = ph[f"seq_{kind}"], ph[f"par_{kind}"]
            print(f"{label:22} {seq.p50:18.0f} {seq.p99:8.0f} {par.rate:22.0f}")
        p50_ok = ph["seq_http"].p50 <= ph["seq_grpc"].p50
        rate_ok = ph["par_http"].rate >= ph["par_grpc"].rate
        print(f"goal /v1/pick p50 <= gRPC p50 at 1 client: "
              f"{ph['seq_http'].p50 / ph['seq_grpc'].p50:.2f}x {'met' if p50_ok else 'MISSED'}")
        print(f"goal /v1/pick calls/s >= gRPC at {args.threads} clients: "
              f"{ph['par_http'].rate / ph['par_grpc'].rate:.2f}x "
              f"{'met' if rate_ok else 'MISSED'}")
        doc = {k: {"p50_us": v.p50, "p99_us": v.p99, "calls_per_s": v.rate,
                   "calls": v.calls} for k, v in ph.items()}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
