"""Shared test doubles that are real implementations, not mocks.

``FakeVLLM``
    A real HTTP server (stdlib ``ThreadingHTTPServer``, 127.0.0.1, a free port) serving
    a model server's ``/metrics`` page. Change what it serves at any time::

        server = fake_vllm(vllm_page(waiting=3, kv=0.5))  # the conftest fixture
        server.address              # "127.0.0.1:<port>" — the EndpointSpec address
        server.page = vllm_page(waiting=9)                # next scrape sees 9
        server.status = 500         # answer HTTP 500 (page ignored) until set back to 200
        server.hang = True          # accept, then never answer until hang=False or stop()
        server.hits                 # requests answered or hung so far
        server.stop()               # kill it: the port refuses connections afterwards

    Connections are kept alive (HTTP/1.1, as vLLM's uvicorn does); ``stop()`` shuts every
    open connection down too, so no kept-alive connection outlives the server.

``vllm_page(...)``
    A realistic vLLM page: the gauges the pool reads plus histogram noise it must skip.

``MemoryReader`` / ``MemoryEngine``
    The pool's reader seam (``epick.pool.Reader``) served from memory, no socket: for
    tests of the pool's own logic. An engine has FakeVLLM's knobs (``page``, ``status``,
    ``hang``, ``hits``, ``documents``, ``stop()``, ``address``, ``url``)::

        reader = MemoryReader()
        engine = reader.engine(vllm_page(waiting=3))
        pool = Pool([EndpointSpec(address=engine.address)], reader=reader)

    Pages are parsed by the real parser; failures are the ScrapeErrors the HTTP reader
    raises for the same breakage (kinds and messages alike).

``FakeClock``
    A settable monotonic clock (``clock()`` returns ``clock.now``; ``advance(s)``).
"""

from __future__ import annotations

import http
import itertools
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import anyio
import anyio.lowlevel
import msgspec
from anyio.abc import TaskStatus

from epick import abi
from epick.pool import ScrapeError
from epick.pool.fetch import Listing, parse_listing
from epick.pool.parse import ScrapedPage, parse_page

__all__ = ["FakeVLLM", "vllm_page", "FakeClock", "MemoryReader", "MemoryEngine"]


def vllm_page(
    *,
    waiting: float = 0,
    running: float = 0,
    kv: float = 0.0,
    kv_name: str = "vllm:kv_cache_usage_perc",
    running_adapters: str | None = None,
    waiting_adapters: str = "",
    max_lora: int = 4,
    lora_timestamp: float = 1.7e9,
    block_size: int = 16,
    num_gpu_blocks: int = 2048,
    model: str = "m",
) -> str:
    """A vLLM ``/metrics`` page in Prometheus text format.

    ``kv_name`` picks the newer ``vllm:kv_cache_usage_perc`` or the older
    ``vllm:gpu_cache_usage_perc``. ``running_adapters=None`` leaves out
    ``vllm:lora_requests_info`` (LoRA disabled); a string (comma-separated, as vLLM
    writes it) emits one series with ``waiting_adapters``, ``max_lora`` and
    ``lora_timestamp`` as its value.
    """
    m = f'model_name="{model}"'
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{engine="0",{m}}} {float(running)}',
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f'vllm:num_requests_waiting{{engine="0",{m}}} {float(waiting)}',
        f"# HELP {kv_name} KV-cache usage. 1 means 100 percent usage.",
        f"# TYPE {kv_name} gauge",
        f'{kv_name}{{engine="0",{m}}} {float(kv)}',
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ]
    for le in ("0.001", "0.01", "0.1", "1.0", "10.0", "+Inf"):
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{le}",{m}}} 7.0')
    lines += [
        f'vllm:time_to_first_token_seconds_count{{engine="0",{m}}} 7.0',
        f'vllm:time_to_first_token_seconds_sum{{engine="0",{m}}} 0.42',
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",'
        f'gpu_memory_utilization="0.9",num_gpu_blocks="{num_gpu_blocks}"}} 1.0',
    ]
    if running_adapters is not None:
        lines += [
            "# TYPE vllm:lora_requests_info gauge",
            f'vllm:lora_requests_info{{max_lora="{max_lora}",'
            f'running_lora_adapters="{running_adapters}",'
            f'waiting_lora_adapters="{waiting_adapters}"}} {lora_timestamp!r}',
        ]
    return "\n".join(lines) + "\n"


class FakeVLLM:
    """A real ``/metrics`` HTTP server on 127.0.0.1; see the module docstring."""

    def __init__(self, page: str | None = None) -> None:
        self.page: str = page if page is not None else vllm_page()
        self.status: int = 200
        self.hang: bool = False
        self.hits: int = 0
        self._stopped = threading.Event()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        #: Other paths it answers (JSON), e.g. ``{"/v1/models": ...}``; every other path
        #: gets the page.
        self.documents: dict[str, str] = {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive
            timeout = 10  # an idle kept-alive client must not pin a handler thread forever
            # Headers and body go out in two writes: without this, Nagle + delayed ACK
            # hold every kept-alive answer back ~40 ms.
            disable_nagle_algorithm = True

            def setup(self) -> None:
                super().setup()
                with fake._lock:
                    fake._connections.add(self.connection)

            def finish(self) -> None:
                with fake._lock:
                    fake._connections.discard(self.connection)
                try:
                    super().finish()
                except OSError:
                    pass  # the client went away (e.g. gave up on a hung request)

            def do_GET(self) -> None:  # noqa: N802 (stdlib name)
                fake.hits += 1
                while fake.hang and not fake._stopped.is_set():
                    time.sleep(0.005)
                if fake._stopped.is_set():
                    self.close_connection = True
                    return  # killed mid-request: close without answering
                status, body = fake.status, fake.page.encode()
                content_type = "text/plain; version=0.0.4; charset=utf-8"
                if self.path in fake.documents:  # e.g. /v1/models
                    body, content_type = fake.documents[self.path].encode(), "application/json"
                if status != 200:
                    body = b"Internal Server Error\n"
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    self.close_connection = True  # the client gave up waiting

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass  # keep test output clean

        class Server(ThreadingHTTPServer):
            daemon_threads = False  # stop() joins every handler

            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client hanging up mid-answer is expected here, not a test failure

        self._server = Server(("127.0.0.1", 0), Handler)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"FakeVLLM:{self.port}",
        )
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def stop(self) -> None:
        """Kill the server (idempotent): releases hung requests, refuses new ones."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._server.shutdown()  # no new connections are accepted
        with self._lock:
            for conn in self._connections:  # end kept-alive connections: a real kill
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._server.server_close()  # closes the listener, joins handler threads
        self._thread.join()


class FakeClock:
    """A monotonic clock the test moves by hand: pass it as ``clock=``."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class MemoryEngine:
    """One engine a :class:`MemoryReader` serves; see the module docstring."""

    def __init__(self, address: str, page: str | None = None) -> None:
        self.address = address
        self.page: str = page if page is not None else vllm_page()
        self.status: int = 200
        self.hang: bool = False
        self.hits: int = 0
        self.stopped = False
        #: Other paths it answers, e.g. ``{"/v1/models": ...}``; every other path gets
        #: the page (as FakeVLLM does).
        self.documents: dict[str, str] = {}

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def stop(self) -> None:
        """Kill it: a hung read ends as a dropped connection, later ones are refused."""
        self.stopped = True


class MemoryReader:
    """An ``epick.pool.Reader`` over :class:`MemoryEngine` objects, found by the URL's
    host:port (as HTTP would: an endpoint's ``metrics_url`` may name another host)."""

    #: Addresses are unique in the test run, so no test reads another's telemetry series.
    _addresses = itertools.count()

    def __init__(self) -> None:
        self.engines: dict[str, MemoryEngine] = {}
        self.forgotten: list[str] = []
        """Addresses the pool said left it, in order."""
        self.running = False

    def engine(self, page: str | None = None) -> MemoryEngine:
        """A new engine on a new address (``mem-<n>:8000``)."""
        engine = MemoryEngine(f"mem-{next(self._addresses)}:8000", page)
        self.engines[engine.address] = engine
        return engine

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.running = True
        try:
            task_status.started()
            await anyio.sleep_forever()
        finally:
            self.running = False

    async def _answer(self, url: str, timeout_s: float) -> str:
        """The text at ``url``, or the ScrapeError HTTP would give."""
        if not self.running:
            raise RuntimeError("MemoryReader: read before run() started (or after it ended)")
        parts = urlsplit(url)
        engine = self.engines.get(parts.netloc)
        if engine is None or engine.stopped:
            raise ScrapeError(url, f"Cannot connect to host {parts.netloc}", kind="network")
        engine.hits += 1
        try:
            with anyio.fail_after(timeout_s):
                while engine.hang and not engine.stopped:
                    await anyio.sleep(0.002)
        except TimeoutError as exc:
            raise ScrapeError(url, f"no answer within {timeout_s * 1000:g} ms",
                              kind="timeout") from exc
        if engine.stopped:
            raise ScrapeError(url, "Server disconnected", kind="network")
        await anyio.lowlevel.checkpoint()  # a read always yields, as a socket read does
        if engine.status != 200:
            phrase = http.HTTPStatus(engine.status).phrase
            raise ScrapeError(url, f"HTTP {engine.status} {phrase}", kind="http-status")
        return engine.documents.get(parts.path, engine.page)

    async def read_page(self, *, url: str, engine: str, address: str,
                        previous: abi.EndpointMetrics | None, timeout_s: float) -> ScrapedPage:
        text = await self._answer(url, timeout_s)
        return parse_page(text, engine=engine, url=url, previous=previous, address=address)

    async def read_models(self, *, url: str, address: str, timeout_s: float) -> Listing:
        try:
            text = await self._answer(url, timeout_s)
            return parse_listing(text.encode())
        except ScrapeError as exc:
            raise ValueError(exc.reason) from exc
        except msgspec.DecodeError as exc:
            raise ValueError(str(exc)) from exc

    def forget(self, address: str) -> None:
        self.forgotten.append(address)
