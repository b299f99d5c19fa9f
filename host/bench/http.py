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
import threading
import time
from pathlib import Path

from google.protobuf import json_format

from epick.bench.dataplanes import free_port
from epick.bench.grpc import Phase, Setup, requests, unary_phase

__all__ = ["main", "measure", "http_phase"]


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
    out: list[list[float]] = [[] for _ in range(threads)]
    errors: list[str] = []
    stop = time.perf_counter() + seconds
    raws = [(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
             f"\r\nContent-Length: {len(b)}\r\n\r\n").encode() + b for b in bodies]

    def connect() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def worker(k: int) -> None:
        sock = connect()
        lat, i, perf = out[k], k, time.perf_counter
        try:
            while True:
                t0 = perf()
                try:
                    sock.sendall(raws[i % len(raws)])
                    status, _body = _read_response(sock)
                except (ConnectionError, _Closed):
                    # A server ends keep-alive after so many requests (NGINX: 1,000):
                    # reconnect, and time the request again from there.
                    sock.close()
                    sock = connect()
                    t0 = perf()
                    sock.sendall(raws[i % len(raws)])
                    status, _body = _read_response(sock)
                lat.append((perf() - t0) * 1e6)
                if status != 200:
                    errors.append(f"{status} {_body[:200]!r}")
                    return
                i += threads
                if perf() >= stop:
                    break
        finally:
            sock.close()

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise RuntimeError(f"POST {path} failed during the benchmark: {errors[0]}")
    return [x for lat in out for x in lat]


class _Closed(Exception):
    """The server closed the connection before answering."""


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise _Closed
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise RuntimeError("the server closed the connection")
        body += chunk
    return int(lines[0].split()[1]), body


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
                        ph = phases.setdefault(f"{mode}_{kind}", Phase())
                        t0 = time.perf_counter()
                        lat = (unary_phase(setup.target, "pick", n, per, reqs) if kind == "grpc"
                               else http_phase(setup.http_port, n, per, bodies))
                        ph.seconds += time.perf_counter() - t0
                        ph.latencies_us += lat
                        ph.calls += len(lat)
    finally:
        try:
            setup.stop()
        finally:
            pages.terminate()
            pages.wait(timeout=10)
    return phases


# -- through the proxies (--proxies) ----------------------------------------------------

REPLICA_PAGE = (b'vllm:num_requests_running{model_name="base"} 0.0\n'
                b'vllm:num_requests_waiting{model_name="base"} 0.0\n'
                b'vllm:kv_cache_usage_perc{model_name="base"} 0.1\n')
COMPLETION = json.dumps({"object": "text_completion", "choices": [
    {"index": 0, "text": "hello", "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 1}}).encode()


def _serve_replica() -> None:
    """A model server that answers at once: /metrics and POST /v1/completions."""
    from aiohttp import web

    async def metrics(_request):
        return web.Response(body=REPLICA_PAGE, content_type="text/plain")

    async def complete(request):
        await request.read()
        return web.Response(body=COMPLETION, headers={"Content-Type": "application/json"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", complete)
    _run_aiohttp(lambda: web.AppRunner(app, access_log=None))


def _spawn(args: list[str], what: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise RuntimeError(f"{what} did not start")
    return proc, line.strip()


def measure_proxies(*, seconds: float = 4.0, rounds: int = 4, clients=(1, 8)
                    ) -> dict[str, dict[int, Phase]]:
    """NGINX and HAProxy from the committed examples, each routing through epick and
    round robin (no epick call), alternated in rounds; {path: {clients: Phase}}."""
    from epick.bench.dataplanes import Proxy

    procs: list[subprocess.Popen] = []
    proxies: dict[str, Proxy] = {}
    body = [json.dumps({"model": "base", "prompt": "Say hello. " * 100,
                        "max_tokens": 1}).encode()]
    out: dict[str, dict[int, Phase]] = {}
    try:
        replica, port = _spawn([sys.executable, "-m", "epick.bench.http", "--serve",
                                "replica"], "the replica")
        procs.append(replica)
        address = f"127.0.0.1:{port}"
        http_port = free_port()
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "epick.toml"
            config.write_text("\n".join([
                "version = 1", "[server]", 'listen = "127.0.0.1:0"', 'metrics_listen = ""',
                "[admin]", 'listen = ""', "[http]", f'listen = "127.0.0.1:{http_port}"',
                "[openai]", 'base_model = "base"', "[pool]", "scrape_interval_ms = 50",
                "[[pool.endpoints]]", f'address = "{address}"',
                *(f'[[policies]]\nname = "{p}"\nmodule = "{p}"'
                  for p in ("load", "prefix-cache", "lora-affinity"))]) + "\n")
            epick, line = _spawn([sys.executable, "-m", "epick.cli", "--log-level", "WARNING",
                                  "serve", "--config", str(config)], "epick serve")
            procs.append(epick)
            if "serving Pick on" not in line:
                raise RuntimeError(f"epick serve did not start: {line!r}")
            for kind in ("nginx", "haproxy"):
                for routed in (False, True):
                    name = f"{kind} + epick" if routed else f"{kind} round robin"
                    proxies[name] = Proxy(kind, epick_http_port=http_port, replicas=[address],
                                          epick=routed).start()
            for p in proxies.values():
                http_phase(p.port, 1, 0.2, body, "/v1/completions")  # warm, and check
            per = seconds / rounds
            for _ in range(rounds):
                for n in clients:
                    for name, p in proxies.items():
                        ph = out.setdefault(name, {}).setdefault(n, Phase())
                        t0 = time.perf_counter()
                        lat = http_phase(p.port, n, per, body, "/v1/completions")
                        ph.seconds += time.perf_counter() - t0
                        ph.latencies_us += lat
                        ph.calls += len(lat)
    finally:
        for p in proxies.values():
            p.stop()
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
    return out


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
    _run_aiohttp(lambda: web.AppRunner(app, access_log=None))


def _serve_aiohttp_lowlevel() -> None:
    from aiohttp import web

    async def pick(request):
        await request.read()
        return web.Response(body=ANSWER, headers={"Content-Type": "application/json"})

    _run_aiohttp(lambda: web.ServerRunner(web.Server(pick, access_log=None)))


def _run_aiohttp(make_runner) -> None:
    import asyncio

    from aiohttp import web

    async def main() -> None:
        runner = make_runner()  # (web.Server wants the running loop)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
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


SERVERS = {"replica": _serve_replica,
           "aiohttp (web.Application)": _serve_aiohttp_app,
           "aiohttp (low-level web.Server)": _serve_aiohttp_lowlevel,
           "asyncio Protocol, hand parser (floor)": _serve_asyncio_raw}


def measure_servers(*, seconds: float = 2.0, threads: int = 8) -> dict[str, dict[str, Phase]]:
    body = [json.dumps({"model": "llama", "prompt": "hi"}).encode()]
    out = {}
    for name in SERVERS:
        if name == "replica":
            continue
        proc = subprocess.Popen([sys.executable, "-m", "epick.bench.http", "--serve", name],
                                stdout=subprocess.PIPE, text=True)
        try:
            port = int(proc.stdout.readline())
            http_phase(port, 1, 0.2, body)
            out[name] = {}
            for mode, n in (("seq", 1), ("par", threads)):
                ph = out[name][mode] = Phase()
                t0 = time.perf_counter()
                ph.latencies_us = http_phase(port, n, seconds, body)
                ph.seconds = time.perf_counter() - t0
                ph.calls = len(ph.latencies_us)
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
                    help="the latency NGINX and HAProxy add with epick vs round robin")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args(argv)
    if args.serve:
        SERVERS[args.serve]()
        return 0
    if args.proxies:
        res = measure_proxies(seconds=args.seconds, rounds=args.rounds,
                              clients=(1, args.threads))
        print(f"{'path':22} {'clients':>7} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>7} "
              f"{'added p50 / p99 ms':>20}")
        doc = {}
        for name, by_n in res.items():
            for n, ph in by_n.items():
                added = ""
                if name.endswith("+ epick"):
                    base = res[name.replace("+ epick", "round robin")][n]
                    added = f"{(ph.p50 - base.p50) / 1e3:.2f} / {(ph.p99 - base.p99) / 1e3:.2f}"
                print(f"{name:22} {n:7} {ph.p50 / 1e3:8.2f} {ph.p99 / 1e3:8.2f} "
                      f"{ph.rate:7.0f} {added:>20}")
                doc[f"{name} @{n}"] = {"p50_ms": ph.p50 / 1e3, "p99_ms": ph.p99 / 1e3,
                                       "req_per_s": ph.rate}
    elif args.servers:
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
