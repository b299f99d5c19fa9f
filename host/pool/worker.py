"""The scrape worker: a child process that fetches and parses metrics pages for the pool.

Why a process: parsing a vLLM page is ~300 µs of pure Python, 64 endpoints every 50 ms
are ~1,300 pages a second, and on the event loop every one of them holds up the picks
waiting behind it (Pick p99 ×3 with scraping in ``docs/performance.md``). A thread would
not help — the parser holds the GIL. In the child, the loop's cost per scrape is one
request written and one answer decoded (a few µs each).

Protocol (this module is both ends of it): the parent writes requests on the child's
stdin, the child writes one answer per request on its stdout, in any order, matched by
``id``. Each frame is a 4-byte big-endian length and a msgpack array (a tagged
:class:`Request` or :class:`Answer`). The child keeps no state but one HTTP session per
endpoint address; the parent's :class:`~epick.pool.pool.Pool` keeps all of it (rounds,
back-off, freshness, the last good metrics it passes as ``previous``). The child exits
when its stdin closes, so it never outlives the parent.

Ownership: :meth:`ScrapeWorker.run` owns the process — it starts it, restarts it after
:data:`RESTART_S` if it dies (every call in flight then fails with ``kind="worker"`` and
the pool backs off as for any failed scrape), and stops it when cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import msgspec
from anyio.abc import TaskStatus

from epick import abi
from epick.pool.errors import ScrapeError
from epick.pool.fetch import HttpReader, Listing
from epick.pool.parse import ScrapedPage

__all__ = ["ScrapeWorker", "RESTART_S"]

log = logging.getLogger("epick.pool")

#: Wait before starting a worker again after it died.
RESTART_S = 1.0

#: The watchdog looks every WATCH_S seconds and restarts a worker that stayed silent,
#: with calls past their deadline, for HUNG_TICKS looks in a row.
WATCH_S = 0.5
HUNG_TICKS = 4

#: A frame longer than this is a protocol error (a page answer is a few KiB).
MAX_FRAME = 64 << 20

_LEN = struct.Struct(">I")


# --- the protocol ---------------------------------------------------------------------


class PageRequest(msgspec.Struct, array_like=True, tag="page"):
    id: int
    url: str
    engine: str
    address: str
    previous: abi.EndpointMetrics | None
    timeout_s: float


class ModelsRequest(msgspec.Struct, array_like=True, tag="models"):
    id: int
    url: str
    address: str
    timeout_s: float


class Forget(msgspec.Struct, array_like=True, tag="forget"):
    """The endpoint left the pool: close its session."""

    address: str


Request = PageRequest | ModelsRequest | Forget


class PageAnswer(msgspec.Struct, array_like=True, tag="page"):
    id: int
    page: ScrapedPage


class ModelsAnswer(msgspec.Struct, array_like=True, tag="models"):
    id: int
    listing: Listing


class Failed(msgspec.Struct, array_like=True, tag="failed"):
    id: int
    reason: str
    kind: str
    """A ScrapeError kind; ``""`` for a models listing that failed."""


Answer = PageAnswer | ModelsAnswer | Failed

_encode = msgspec.msgpack.Encoder().encode


def _frame(message: msgspec.Struct) -> bytes:
    body = _encode(message)
    return _LEN.pack(len(body)) + body


# --- the parent's end -----------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Call:
    url: str
    deadline: float
    """Loop time after which the worker is presumed hung."""
    answer: asyncio.Future


class ScrapeWorker:
    """The parent's handle on the worker process; used from the pool's event loop only.

    The hot path is plain asyncio (a buffered pipe write, a future per call): with
    ~1,300 calls a second, anyio's per-call lock and cancel scope were a third of the
    loop's cost per scrape. Structure stays anyio's: :meth:`run` is the owner.
    """

    def __init__(self, command: list[str] | None = None, *, nice: int = 0,
                 cpus: Sequence[int] = ()) -> None:
        if not 0 <= nice <= 19:
            raise ValueError(f"ScrapeWorker nice must be 0-19, got {nice!r}")
        cpus = sorted({int(c) for c in cpus})
        # Not ``-m epick.pool.worker``: runpy would import this module twice.
        self._command = command or [
            sys.executable, "-c",
            f"from epick.pool.worker import main; main(nice={nice}, cpus={cpus!r})"]
        self._proc: asyncio.subprocess.Process | None = None
        self._calls: dict[int, _Call] = {}
        self._next_id = 0
        self.starts = 0
        """Processes started (1 + restarts); for tests and logs."""
        self.answers = 0
        """Answers read from every worker so far (the watchdog's sign of life)."""

    @property
    def pid(self) -> int | None:
        """The running worker's process id, if one runs."""
        return None if self._proc is None else self._proc.pid

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep a worker running until cancelled; ``started()`` once the first is spawned."""
        decoder = msgspec.msgpack.Decoder(Answer)
        started = False
        while True:
            proc = await asyncio.create_subprocess_exec(
                *self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                limit=MAX_FRAME)
            self.starts += 1
            self._proc = proc
            if not started:
                task_status.started()
                started = True
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._watch, tg.cancel_scope)
                    await self._read_answers(proc, decoder)
                    tg.cancel_scope.cancel()
            finally:
                self._proc = None
                with anyio.CancelScope(shield=True):
                    code = await _stop(proc)
                self._fail_all(f"the scrape worker exited (code {code})")
            log.error("scrape worker exited with code %s; starting another in %.0f s",
                      code, RESTART_S)
            await anyio.sleep(RESTART_S)

    async def _read_answers(self, proc: asyncio.subprocess.Process,
                            decoder: msgspec.msgpack.Decoder) -> None:
        assert proc.stdout is not None
        read = proc.stdout.readexactly
        try:
            while True:
                (size,) = _LEN.unpack(await read(_LEN.size))
                if size > MAX_FRAME:
                    log.error("scrape worker sent a %d-byte frame; restarting it", size)
                    return
                try:
                    answer = decoder.decode(await read(size))
                except msgspec.DecodeError as exc:
                    log.error("scrape worker sent a bad frame (%s); restarting it", exc)
                    return
                self.answers += 1
                call = self._calls.pop(answer.id, None)
                if call is not None and not call.answer.done():  # else its caller gave up
                    call.answer.set_result(answer)
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    async def _watch(self, scope: anyio.CancelScope) -> None:
        """Restart a worker that has gone silent: calls past their deadline and no answer
        at all for :data:`HUNG_TICKS` ticks in a row. The worker bounds every read itself,
        so only a hung worker is silent that long; counting ticks, not clock time, keeps a
        paused or starved process (SIGSTOP, a loaded machine) from looking hung when it
        resumes."""
        loop = asyncio.get_running_loop()
        strikes, seen = 0, self.answers
        while True:
            await anyio.sleep(WATCH_S)
            now = loop.time()
            overdue = any(c.deadline < now for c in self._calls.values())
            strikes = strikes + 1 if overdue and self.answers == seen else 0
            seen = self.answers
            if strikes >= HUNG_TICKS:
                log.error("scrape worker answered nothing for %d checks with calls past "
                          "their deadline; restarting it", strikes)
                scope.cancel()
                return

    def _fail_all(self, reason: str) -> None:
        calls, self._calls = self._calls, {}
        for call_id, call in calls.items():
            if not call.answer.done():
                call.answer.set_result(Failed(id=call_id, reason=reason, kind="worker"))

    def _send(self, message: msgspec.Struct) -> bool:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdin.is_closing():
            return False
        proc.stdin.write(_frame(message))  # buffered; frames stay whole and in order
        return True

    async def _call(self, url: str, make: type, timeout_s: float, **fields) -> Answer:
        self._next_id += 1
        call_id = self._next_id
        loop = asyncio.get_running_loop()
        call = _Call(url, loop.time() + timeout_s + 2.0, loop.create_future())
        if not self._send(make(id=call_id, url=url, timeout_s=timeout_s, **fields)):
            raise ScrapeError(url, "the scrape worker is restarting", kind="worker")
        self._calls[call_id] = call
        try:
            return await call.answer
        finally:
            self._calls.pop(call_id, None)

    async def read_page(
        self, *, url: str, engine: str, address: str,
        previous: abi.EndpointMetrics | None, timeout_s: float,
    ) -> ScrapedPage:
        """:func:`epick.pool.fetch.read_page`, in the worker."""
        answer = await self._call(url, PageRequest, timeout_s, engine=engine,
                                  address=address, previous=previous)
        if isinstance(answer, PageAnswer):
            return answer.page
        if isinstance(answer, Failed):
            raise ScrapeError(url, answer.reason, kind=answer.kind or "worker")
        raise ScrapeError(url, "the scrape worker answered a page read with a listing",
                          kind="worker")

    async def read_models(self, *, url: str, address: str, timeout_s: float) -> Listing:
        """:func:`epick.pool.fetch.read_models`, in the worker (``ValueError`` if none)."""
        try:
            answer = await self._call(url, ModelsRequest, timeout_s, address=address)
        except ScrapeError as exc:
            raise ValueError(exc.reason) from exc
        if isinstance(answer, ModelsAnswer):
            return answer.listing
        raise ValueError(answer.reason if isinstance(answer, Failed) else "bad answer")

    def forget(self, address: str) -> None:
        """Close the worker's session for an endpoint that left the pool (best effort)."""
        self._send(Forget(address=address))


async def _stop(proc: asyncio.subprocess.Process) -> int | None:
    """Close the child's stdin (it exits on EOF); kill it if it has not after 2 s."""
    if proc.stdin is not None:
        proc.stdin.close()
    with anyio.move_on_after(2.0):
        return await proc.wait()
    proc.kill()
    return await proc.wait()


# --- the child's end ------------------------------------------------------------------


async def _serve(reader: asyncio.StreamReader, out) -> None:
    decoder = msgspec.msgpack.Decoder(Request)
    http = HttpReader()  # the very reader the pool uses on its own loop
    write_lock = asyncio.Lock()

    async def answer(message: msgspec.Struct) -> None:
        async with write_lock:
            out.write(_frame(message))
            await out.drain()

    async def handle(req: PageRequest | ModelsRequest) -> None:
        try:
            if isinstance(req, PageRequest):
                page = await http.read_page(url=req.url, engine=req.engine,
                                            address=req.address, previous=req.previous,
                                            timeout_s=req.timeout_s)
                reply: msgspec.Struct = PageAnswer(id=req.id, page=page)
            else:
                listing = await http.read_models(url=req.url, address=req.address,
                                                 timeout_s=req.timeout_s)
                reply = ModelsAnswer(id=req.id, listing=listing)
        except ScrapeError as exc:
            reply = Failed(id=req.id, reason=exc.reason, kind=exc.kind)
        except ValueError as exc:  # a models listing
            reply = Failed(id=req.id, reason=str(exc), kind="")
        except Exception as exc:  # a parser bug must cost one scrape, not the worker
            log.exception("reading %s failed unexpectedly", req.url)
            reply = Failed(id=req.id, reason=f"{type(exc).__name__}: {exc}", kind="parse")
        await answer(reply)

    async with anyio.create_task_group() as tg:
        await tg.start(http.run)  # closes every session when the task group ends
        while True:
            try:
                (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                req = decoder.decode(await reader.readexactly(size))
            except asyncio.IncompleteReadError:
                tg.cancel_scope.cancel()  # stdin closed: the parent is done with us
                return
            if isinstance(req, Forget):
                http.forget(req.address)
            else:
                tg.start_soon(handle, req)


async def _main() -> None:
    loop = asyncio.get_running_loop()
    # The protocol owns the real stdout; anything else that prints goes to stderr.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    reader = asyncio.StreamReader(limit=MAX_FRAME)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(out_fd, "wb", buffering=0))
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    await _serve(reader, writer)


def main(nice: int = 0, cpus: Sequence[int] = ()) -> None:
    logging.basicConfig(level=logging.WARNING, format="epick scrape worker: %(message)s")
    if nice:
        # Scraping is background work: where the cores are short, picks go first.
        os.nice(nice)
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:  # not in this cgroup's cpuset: scrape anyway, say why
            logging.getLogger("epick.pool.worker").error(
                "[pool] scrape_worker_cpus %s refused by the kernel (%s); the scrape worker "
                "runs on the service's CPUs", list(cpus), exc)
    try:
        anyio.run(_main)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the parent decides
        pass


if __name__ == "__main__":
    main()
