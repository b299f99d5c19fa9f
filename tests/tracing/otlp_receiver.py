"""A real OpenTelemetry collector for the tracing tests: rotel's bundled agent (PyPI
``rotel``) receives OTLP/gRPC from epick and exports OTLP/HTTP to :class:`SpanSink`, a
small receiver here that decodes what arrives with the OTLP protobufs
(``opentelemetry-proto``) so a test can read the spans.

Why the sink: rotel's exporters write to other services (OTLP, Kafka, ClickHouse...), not
to a file; its debug log prints spans as text meant for eyes. The spans a test reads have
gone through the collector's OTLP receiver, batching and OTLP exporter.
"""

from __future__ import annotations

import gzip
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import rotel
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

ROTEL_AGENT = Path(rotel.__file__).parent / "rotel-agent"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SpanSink:
    """An OTLP/HTTP trace receiver on a free loopback port; ``spans(trace_id)`` waits."""

    def __init__(self) -> None:
        self.spans: list = []  # opentelemetry.proto.trace.v1.Span, with .resource attached
        self.resources: list = []
        self._cond = threading.Condition()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the stdlib's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                with sink._cond:
                    for rs in req.resource_spans:
                        for ss in rs.scope_spans:
                            for span in ss.spans:
                                sink.spans.append(span)
                                sink.resources.append(rs.resource)
                    sink._cond.notify_all()
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def wait(self, trace_id: bytes, count: int = 1, timeout: float = 20.0) -> list:
        """The spans of ``trace_id`` once at least ``count`` arrived (or what did)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [s for s in self.spans if s.trace_id == trace_id]
                left = deadline - time.monotonic()
                if len(found) >= count or left <= 0:
                    return found
                self._cond.wait(left)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Collector:
    """rotel receiving OTLP/gRPC on :attr:`grpc_endpoint`, exporting to a :class:`SpanSink`."""

    def __init__(self, tmp: Path) -> None:
        self.sink = SpanSink()
        self.grpc_port, http_port = free_port(), free_port()
        self.log = tmp / "rotel.out"
        self.proc = subprocess.Popen(
            [str(ROTEL_AGENT), "start",
             "--otlp-grpc-endpoint", f"127.0.0.1:{self.grpc_port}",
             "--otlp-http-endpoint", f"127.0.0.1:{http_port}",
             "--pid-file", str(tmp / "rotel.pid"), "--log-file", str(tmp / "rotel.log"),
             "--exporter", "otlp", "--otlp-exporter-protocol", "http",
             "--otlp-exporter-endpoint", f"http://127.0.0.1:{self.sink.port}",
             "--batch-timeout", "50ms"],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.grpc_port), timeout=0.5).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"rotel did not start: {self.log.read_text()}") from None
                time.sleep(0.05)

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.sink.close()
