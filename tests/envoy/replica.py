"""A real OpenAI-style model server for the Envoy tests: ``/metrics`` plus completions.

    replica = Replica(page=vllm_page(waiting=3))
    replica.address                  # "127.0.0.1:<port>", what epick's pool lists
    replica.page = vllm_page(...)    # what the next scrape sees
    replica.requests                 # [(path, headers, body)] of the completions it served

``POST /v1/completions`` and ``/v1/chat/completions`` answer a JSON completion naming the
replica (``served_by``, and the header ``x-served-by``); with ``"stream": true`` they send
``chunks`` SSE events ``chunk_delay_s`` apart (each with ``sent_at``, the Unix time it
was written), then — when the body set ``stream_options.include_usage`` — a usage event,
then ``data: [DONE]``. Answers carry ``usage``: ``prompt_tokens`` = the prompt's words,
``completion_tokens`` = ``chunks`` (streamed) or 1. ``delay_s`` holds every completion
answer back that long before its headers. ``GET /v1/models`` lists the base model and
``adapters``, as vLLM does. Everything
else is 404.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fakes import vllm_page

__all__ = ["Replica"]


class Replica:
    def __init__(self, page: str | None = None, *, chunks: int = 5,
                 chunk_delay_s: float = 0.0, delay_s: float = 0.0) -> None:
        self.page = page if page is not None else vllm_page()
        #: Adapters its /v1/models lists (epick learns what it serves from there).
        self.adapters: tuple[str, ...] = ("sql-lora",)
        self.chunks = chunks
        self.chunk_delay_s = chunk_delay_s
        self.delay_s = delay_s
        self.requests: list[tuple[str, dict[str, str], dict]] = []
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        replica = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 10
            disable_nagle_algorithm = True

            def setup(self) -> None:
                super().setup()
                with replica._lock:
                    replica._connections.add(self.connection)

            def finish(self) -> None:
                with replica._lock:
                    replica._connections.discard(self.connection)
                try:
                    super().finish()
                except OSError:
                    pass

            def _send(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("x-served-by", replica.address)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/metrics":
                    self._send(200, replica.page.encode(), "text/plain; version=0.0.4")
                elif self.path == "/v1/models":
                    # As vLLM lists them: the base model, then each adapter with its parent.
                    data = [{"id": "base", "object": "model", "parent": None}]
                    data += [{"id": a, "object": "model", "parent": "base"}
                             for a in replica.adapters]
                    self._send(200, json.dumps({"object": "list", "data": data,
                                                "served_by": replica.address}
                    ).encode(), "application/json")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _body(self) -> bytes:
                if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
                    return self.rfile.read(int(self.headers.get("Content-Length", 0)))
                # Envoy streams a body it got back from ext_proc (FULL_DUPLEX_STREAMED)
                # chunked, as real model servers (uvicorn) accept.
                parts = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return b"".join(parts)
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()

            def do_POST(self) -> None:  # noqa: N802
                body = self._body()
                if not self.path.startswith("/v1/"):
                    self._send(404, b"not found\n", "text/plain")
                    return
                doc = json.loads(body)
                with replica._lock:
                    replica.requests.append(
                        (self.path, {k.lower(): v for k, v in self.headers.items()}, doc))
                prompt = doc.get("prompt", "")
                words = len(prompt.split()) if isinstance(prompt, str) else 0
                if replica.delay_s:
                    time.sleep(replica.delay_s)
                if not doc.get("stream"):
                    self._send(200, json.dumps({
                        "object": "text_completion", "model": doc.get("model"),
                        "choices": [{"index": 0, "text": "hello", "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": words, "completion_tokens": 1},
                        "served_by": replica.address}).encode(), "application/json")
                    return
                usage = (doc.get("stream_options") or {}).get("include_usage")
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("x-served-by", replica.address)
                self.end_headers()
                events = [json.dumps({"choices": [{"index": 0, "text": f"t{i}"}]})
                          for i in range(replica.chunks)]
                if usage:
                    events.append(json.dumps({"choices": [], "usage": {
                        "prompt_tokens": words, "completion_tokens": replica.chunks}}))
                events.append("[DONE]")
                for i, event in enumerate(events):
                    if i and i < replica.chunks and replica.chunk_delay_s:
                        time.sleep(replica.chunk_delay_s)
                    if i < replica.chunks:
                        event = event[:-1] + f', "sent_at": {time.time()!r}}}'
                    data = f"data: {event}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = False
            # A burst of connections at once (the native front end releases a blocked
            # loop's decisions together) must not overflow socketserver's backlog of 5.
            request_queue_size = 128

            def handle_error(self, request: object, client_address: object) -> None:
                pass

        self._server = Server(("127.0.0.1", 0), Handler)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, name=f"Replica:{self.port}")
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.shutdown()
        with self._lock:
            for conn in self._connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._server.server_close()
        self._thread.join()


@pytest.fixture(name="replicas")
def replicas_fixture() -> Iterator:
    """``replicas(n, page=None, **kw)``: n started replicas, all stopped after the
    test (a fixture for the Envoy and the NGINX/HAProxy suites; their conftests import it)."""
    started: list[Replica] = []

    def start(n: int, page: str | None = None, **kw) -> list[Replica]:
        new = [Replica(page, **kw) for _ in range(n)]
        started.extend(new)
        return new

    yield start
    for r in started:
        r.stop()
