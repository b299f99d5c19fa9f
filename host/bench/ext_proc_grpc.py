"""What an ext_proc stream and each of its messages cost epick's gRPC server (CPU), for an
answered stream (FULL_DUPLEX_STREAMED: every chunk streamed back) and an observer's
(``observability_mode``: nothing answered).

    epick bench ext-proc-grpc [--streams 2000] [--chunks 0,22] [--concurrency 200]

The server is epick's own ``ExtProcService`` on a grpc.aio server, in its own process
(the decider is a stub: no stream here routes; each plays an answer's part: response
headers carrying a decision id, then ``--chunks`` SSE chunks of ~50 bytes, the last one
ending the answer). The client (this process, grpc.aio, 10 channels) keeps
``--concurrency`` streams open at once. Printed: the server process's CPU (user +
system, from /proc) per stream, for each chunk count and mode; per chunk is the
difference between two chunk counts divided by the chunks. What it shows: the fixed
cost of a stream against the cost of a message, which is what decides whether a second
stream per request (the observer) pays.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path


def _server_main(port_q) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from epick.api import ext_proc
    from epick.config import ExtProcConfig, OpenAIConfig

    class _Decider:
        scheduler = None

        def complete(self, **_kw) -> None:
            pass

        def decide(self, *_a, **_kw):
            raise RuntimeError("no stream routes here")

    async def main() -> None:
        svc = ext_proc.ExtProcService(
            _Decider(), ExtProcConfig(listen="127.0.0.1:0", base_model="base"),
            OpenAIConfig(base_model="base"))
        server = grpc.aio.server(options=ext_proc.PENDING_CALLS_OPTIONS)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            ext_proc.SERVICE_NAME, {"Process": grpc.stream_stream_rpc_method_handler(
                svc.Process, request_deserializer=ep.ProcessingRequest.FromString,
                response_serializer=ext_proc._serialize)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_q.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _messages(chunks: int, observer: bool) -> list:
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    heads = ep.ProcessingRequest(response_headers=ep.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v) for k, v in (
                (":status", b"200"), ("content-type", b"text/event-stream"),
                ("x-epick-decision-id", b"d-1"))]),
        end_of_stream=chunks == 0))
    heads.protocol_config.response_body_mode = (
        processing_mode_pb2.ProcessingMode.STREAMED if observer
        else processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED)
    out = [heads]
    for i in range(chunks):
        out.append(ep.ProcessingRequest(response_body=ep.HttpBody(
            body=b'data: {"choices":[{"index":0,"text":"t%d"}]}\n\n' % i,
            end_of_stream=i == chunks - 1)))
    for m in out:
        m.observability_mode = observer
    return out


async def _client(port: int, streams: int, messages: list, concurrency: int) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(10)]
    stubs = [ep_grpc.ExternalProcessorStub(c) for c in channels]
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            async for _ in stubs[i % len(stubs)].Process(iter(messages)):
                pass

    try:
        await asyncio.gather(*(one(i) for i in range(streams)))
    finally:
        for c in channels:
            await c.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick bench ext-proc-grpc",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=2000, help="streams per cell")
    ap.add_argument("--chunks", default="0,22", help="answer chunks per stream (a list)")
    ap.add_argument("--concurrency", type=int, default=200, help="streams open at once")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.chunks.split(",") if c.strip()]
    q = mp.get_context("spawn").Queue()
    server = mp.get_context("spawn").Process(target=_server_main, args=(q,), daemon=True)
    server.start()
    rows = []
    try:
        port = q.get(timeout=60)
        print(f"# {os.cpu_count()} CPUs; {args.streams} streams a cell, {args.concurrency} "
              f"open at once; load average {os.getloadavg()[0]:.2f}")
        print(f"{'mode':<9} {'chunks':>6} {'server CPU us/stream':>21} {'us/chunk':>9} {'load':>5}")
        for observer in (False, True):
            mode = "observer" if observer else "answered"
            per_stream = {}
            for chunks in counts:
                messages = _messages(chunks, observer)
                asyncio.run(_client(port, 100, messages, args.concurrency))  # warm
                c0 = _cpu_s(server.pid)
                asyncio.run(_client(port, args.streams, messages, args.concurrency))
                us = (_cpu_s(server.pid) - c0) / args.streams * 1e6
                per_stream[chunks] = us
                lo = min(per_stream)
                per_chunk = ((us - per_stream[lo]) / (chunks - lo)) if chunks != lo else None
                rows.append({"mode": mode, "chunks": chunks, "us_per_stream": round(us, 1),
                             "us_per_chunk": per_chunk and round(per_chunk, 1),
                             "load_avg_1m": round(os.getloadavg()[0], 2)})
                print(f"{mode:<9} {chunks:>6} {us:>21.1f} "
                      f"{'' if per_chunk is None else f'{per_chunk:.1f}':>9} "
                      f"{os.getloadavg()[0]:>5.2f}", flush=True)
    finally:
        server.terminate()
        server.join(10)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"streams": args.streams, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
