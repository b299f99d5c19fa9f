"""DecisionLog: records every pick off the pick path, in a bounded, rotated set of files.

    scheduler (event-loop thread)          writer thread (owned by the DecisionLog)
      decision() / completion()              every flush_interval_s (or on sync/close):
        len(queue) < bound? append             drain the queue, encode records,
        else count a queue-full drop           write one batch, rotate, prune old files

The pick path only appends a tuple of references to a deque (or counts a drop when the
queue is full): it never encodes, never touches the disk and never waits. A slow disk
makes the queue fill and records drop (``epick_decision_log_dropped_total{reason=
"queue-full"}``); a failing disk loses the batch (``reason="write-error"``), logs the
error at most every 10 s, and the next batch starts a new file.

Files: the active file is ``path``; when it passes ``max_file_bytes`` or ``rotate_s`` it
is renamed ``path.<start ms, 13 digits>`` (names sort in time order) and a new one
starts. Rotated files are deleted oldest first while all files together exceed
``max_total_bytes``, and when older than ``max_age_s``. Each file is self-contained
(schema: :mod:`epick.decisions.schema`).

Resource handling: :meth:`start` starts the thread, :meth:`close` drains the queue,
writes the last batch, closes the file and joins the thread (the service does both
from its lifespan). The writer never calls into a policy (WASM Stores belong to the
event-loop thread): it only reads immutable values the scheduler handed over.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from epick import abi, telemetry
from epick.decisions import features, schema

__all__ = ["DecisionLog", "segments"]

log = logging.getLogger("epick.decisions")

#: Fields of a queued decision (``decision()``); a queued completion has 8.
_DECISION_ITEM = 13

_FRAME = struct.Struct("<I")
#: Least time between two logged write errors.
_ERROR_LOG_INTERVAL_S = 10.0


def segments(path: Path) -> list[Path]:
    """The files of the log at ``path``, oldest first: rotated ones, then the active one."""
    path = Path(path)
    rotated = sorted(p for p in path.parent.glob(path.name + ".*")
                     if p.suffix[1:].isdigit() and len(p.suffix) == 14)
    return rotated + ([path] if path.exists() else [])


def _marks(policies) -> tuple[tuple[int, int], ...]:
    """Per policy (recoveries, checkpoints) now: where a replay must mirror them."""
    out = []
    for e in policies.entries:
        st = getattr(e.plugin, "stats", None)
        out.append((st.recoveries, st.checkpoints) if st is not None else (0, 0))
    return tuple(out)


def _open_new(path: Path) -> BinaryIO:
    return open(path, "wb")


class DecisionLog:
    """Records decisions and completions to ``path``; see the module docstring.

    Parameters
    ----------
    prompt:
        ``hashes`` (the block hash chain, default), ``full`` (the prompt text) or
        ``none``.
    headers:
        Request header names to record (none by default).
    block_bytes, max_blocks:
        The hash chain's block size and cap; match the prefix-cache policy's params.
    queue:
        Records waiting for the writer at most; beyond it they are dropped and counted.
    modules:
        Where to find a module's bytes by sha256, to embed it in the log
        (:meth:`add_module` adds more); the built-in policies are always found.
    compress:
        Write each batch as one zlib chunk of frames (``schema.CHUNK_FLAG``).
    opener:
        Opens a new file for writing (a seam for tests of failing disks).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        prompt: str = "hashes",
        headers: tuple[str, ...] = (),
        block_bytes: int = 64,
        max_blocks: int = 256,
        max_file_bytes: int = 64 << 20,
        max_total_bytes: int = 1 << 30,
        max_age_s: float = 86400.0,
        rotate_s: float = 3600.0,
        queue: int = 10_000,
        flush_interval_s: float = 0.2,
        embed_modules: bool = True,
        compress: bool = True,
        opener: Callable[[Path], BinaryIO] = _open_new,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if prompt not in ("hashes", "full", "none"):
            raise ValueError(f"decision log prompt {prompt!r}: expected hashes, full or none")
        if block_bytes < 1 or max_blocks < 0 or queue < 1:
            raise ValueError("decision log: block_bytes and queue must be >= 1, max_blocks >= 0")
        self.path = Path(path)
        self.prompt = prompt
        self.headers = tuple(h.lower() for h in headers)
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks
        self.max_file_bytes = max_file_bytes
        self.max_total_bytes = max_total_bytes
        self.max_age_s = max_age_s
        self.rotate_s = rotate_s
        self.max_queue = queue
        self.flush_interval_s = flush_interval_s
        self.embed_modules = embed_modules
        self.compress = compress
        self._opener = opener
        self._wall_clock = wall_clock
        self._queue: deque = deque()
        self._enqueued = 0
        self._handled = 0
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._modules: dict[str, tuple[str, bytes]] = {}
        self._builtins_indexed = False
        self._scheduler = None
        # Writer-thread state.
        self._file: BinaryIO | None = None
        self._size = 0
        self._segment = 0
        self._file_started = 0.0
        self._written_view: object = None
        self._written_versions: set[int] = set()
        self._written_policies: object = None
        self._policies_id = 0
        self._written_modules: set[str] = set()
        self._last_error_log = float("-inf")
        self._last_prune = 0.0
        self._header_written = False
        self._z = None
        self._lost_noted = 0
        self._prune_due = False
        self._seen_marks: dict[object, tuple[int, int]] = {}
        self._dropped_full = telemetry.DECISION_LOG_DROPPED.labels("queue-full")
        self._dropped_error = telemetry.DECISION_LOG_DROPPED.labels("write-error")
        self._records = {k: telemetry.DECISION_LOG_RECORDS.labels(k)
                         for k in ("decision", "completion")}
        self.dropped = {"queue-full": 0, "write-error": 0}
        self.written = {"decision": 0, "completion": 0}

    # -- owner ----------------------------------------------------------------------------

    def attach(self, scheduler) -> DecisionLog:
        """Record ``scheduler``'s decisions (sets ``scheduler.decision_log``)."""
        self._scheduler = scheduler
        scheduler.decision_log = self
        return self

    def start(self) -> DecisionLog:
        """Start the writer thread (a previous run's active file is rotated aside first)."""
        if self._thread is not None:
            raise RuntimeError("DecisionLog already started")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._rename_aside(self.path.stat().st_mtime)
        self._thread = threading.Thread(target=self._run, name="epick-decision-log")
        self._thread.start()
        return self

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued, close the file and join the thread. Idempotent."""
        if self._scheduler is not None and self._scheduler.decision_log is self:
            self._scheduler.decision_log = None
        thread = self._thread
        if thread is None:
            return
        self._stopping = True
        self._wake.set()
        thread.join(timeout)
        self._thread = None

    def sync(self, timeout: float = 30.0) -> bool:
        """Wait until everything enqueued so far is written (or dropped); False on timeout."""
        target = self._enqueued
        deadline = time.monotonic() + timeout
        while self._handled < target:
            if self._thread is None or time.monotonic() > deadline:
                return False
            self._wake.set()
            time.sleep(0.005)
        return True

    def add_module(self, wasm: bytes, name: str = "") -> None:
        """Make a module's bytes available for embedding (keyed by its sha256)."""
        self._modules[hashlib.sha256(wasm).hexdigest()] = (name, bytes(wasm))

    # -- the pick path (DecisionSink) -------------------------------------------------------

    def decision(self, decision, cycle, policies, candidates, scores, shadow_scores,
                 picked) -> None:
        if len(self._queue) >= self.max_queue:
            self.dropped["queue-full"] += 1
            self._dropped_full.inc()
            return
        self._enqueued += 1
        self._queue.append((decision, cycle.request, cycle.view, cycle.now_ms, policies,
                            candidates, scores, shadow_scores, picked, _marks(policies),
                            cycle.assigned(tuple(candidates)),
                            cycle.kv_counts(tuple(candidates)),
                            cycle.kv_cleared(tuple(candidates))))

    def completion(self, decision_id, event, endpoint, prompt_tokens, completion_tokens,
                   ttft_s) -> None:
        if len(self._queue) >= self.max_queue:
            self.dropped["queue-full"] += 1
            self._dropped_full.inc()
            return
        self._enqueued += 1
        policies = self._scheduler.policies if self._scheduler is not None else None
        self._queue.append((decision_id, event, endpoint, prompt_tokens, completion_tokens,
                            ttft_s, policies, _marks(policies) if policies else ()))

    # -- the writer thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait(self.flush_interval_s)
                self._wake.clear()
                stopping = self._stopping
                self._drain()
                if stopping:
                    break
        finally:
            self._close_file()

    def _drain(self) -> None:
        queue = self._queue
        n = len(queue)
        if n == 0:
            self._maybe_prune()
            return
        buf = bytearray()
        kinds: list[str] = []
        for i in range(n):
            item = queue.popleft()
            if self._file is None or self._rotation_due(len(buf)):
                self._write(buf, kinds)
                buf, kinds = bytearray(), []
                if not self._open_segment():
                    lost = n - i  # this record and the rest of the batch
                    for _ in range(lost - 1):
                        queue.popleft()
                    self._count_lost(lost)
                    return
            self._gap(buf)
            try:
                if len(item) == _DECISION_ITEM:  # a decision (a completion has 8)
                    self._encode_decision(buf, item)
                    kinds.append("decision")
                else:
                    self._encode_completion(buf, item)
                    kinds.append("completion")
            except Exception:  # a bug must not stop the writer: lose this record, say so
                log.exception("decision log: cannot encode a record; it is dropped")
                self.dropped["write-error"] += 1
                self._dropped_error.inc()
                self._handled += 1
        self._write(buf, kinds)
        self._maybe_prune()

    def _count_lost(self, n: int) -> None:
        self.dropped["write-error"] += n
        self._dropped_error.inc(n)
        self._handled += n

    def _gap(self, buf: bytearray) -> None:
        """Say in the log how many records were lost since the last written one."""
        lost = self.dropped["queue-full"] + self.dropped["write-error"]
        if lost != self._lost_noted and self._header_written:
            self._frame(buf, schema.Gap(lost=lost - self._lost_noted))
            self._lost_noted = lost

    def _write(self, buf: bytearray, kinds: list[str]) -> None:
        if not kinds and not buf:
            return
        f = self._file
        if self.compress and buf and self._z is not None:
            # One zlib stream per file, one sync-flushed chunk per batch: the window
            # spans batches, so prompt prefixes shared a few requests apart (same hashes)
            # compress even when a batch holds one record. zlib releases the GIL.
            packed = self._z.compress(bytes(buf)) + self._z.flush(zlib.Z_SYNC_FLUSH)
            buf = bytearray(_FRAME.pack(len(packed) | schema.CHUNK_FLAG)) + packed
        try:
            if f is None:
                raise OSError("no open file")
            f.write(buf)
            f.flush()
        except OSError as exc:
            n = len(kinds)
            self._count_lost(n)
            self._error(f"cannot write {self.path}: {exc}; {n} record(s) lost")
            self._close_file()
            return
        self._size += len(buf)
        telemetry.DECISION_LOG_BYTES.inc(len(buf))
        for k in kinds:
            self.written[k] += 1
            self._records[k].inc()
        self._handled += len(kinds)

    def _error(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_error_log >= _ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.error("decision log: %s", message)

    def _rotation_due(self, pending: int) -> bool:
        if self._size + pending >= self.max_file_bytes:
            return True
        return self._wall_clock() - self._file_started >= self.rotate_s

    def _open_segment(self) -> bool:
        if self._file is not None:
            self._close_file()
        if self._file_started and self.path.exists():
            self._rename_aside(self._file_started)
            self._segment += 1
            self._prune_due = True
        try:
            self._file = self._opener(self.path)
            self._file.write(schema.MAGIC)
        except OSError as exc:
            self._error(f"cannot open {self.path}: {exc}")
            self._file = None
            return False
        self._size = len(schema.MAGIC)
        self._z = zlib.compressobj(3) if self.compress else None
        self._file_started = self._wall_clock()
        self._written_view = None
        self._written_versions = set()
        self._written_policies = None
        self._written_modules = set()
        self._header_written = False
        return True

    def _close_file(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError as exc:
                self._error(f"cannot close {self.path}: {exc}")

    def _rename_aside(self, started: float) -> None:
        target = self.path.with_name(f"{self.path.name}.{int(started * 1000):013d}")
        try:
            self.path.rename(target)
        except OSError as exc:
            self._error(f"cannot rotate {self.path} to {target}: {exc}")

    def _maybe_prune(self) -> None:
        now = self._wall_clock()
        if not self._prune_due and now - self._last_prune < 10.0:
            return
        self._last_prune = now
        self._prune_due = False
        files = segments(self.path)
        rotated = [p for p in files if p != self.path]
        try:
            sizes = {p: p.stat().st_size for p in files}
            total = sum(sizes.values())
            for p in rotated:
                too_old = now - p.stat().st_mtime > self.max_age_s
                if total > self.max_total_bytes or too_old:
                    p.unlink()
                    total -= sizes[p]
        except OSError as exc:
            self._error(f"cannot prune old files of {self.path}: {exc}")

    # -- encoding (writer thread) ---------------------------------------------------------

    def _frame(self, buf: bytearray, rec) -> None:
        blob = schema.encoder.encode(rec)
        buf += _FRAME.pack(len(blob))
        buf += blob

    def _header(self, buf: bytearray, decision_id: str, *, first_is_decision: bool) -> None:
        boot, _, seq = decision_id.rpartition("-")
        sched = self._scheduler
        adm = getattr(sched, "admission", None)
        picker = getattr(sched, "picker", None)
        self._frame(buf, schema.Header(
            boot=boot, segment=self._segment, started_ms=int(self._file_started * 1000),
            fresh_start=(self._segment == 0 and first_is_decision and seq == "1"
                         and not self._lost_noted and not any(self.dropped.values())),
            prompt=self.prompt, block_bytes=self.block_bytes, max_blocks=self.max_blocks,
            fallbacks=getattr(sched, "fallbacks", 2),
            picker=getattr(picker, "name", "max"),
            admission_queue=getattr(adm, "queue_threshold", 5),
            admission_kv=float(getattr(adm, "kv_threshold", 0.8)),
            decision_ttl_s=float(getattr(sched, "decision_ttl_s", 600.0)),
            work_conserving=bool(getattr(sched, "work_conserving", False)),
        ))
        self._header_written = True

    def _module_bytes(self, sha: str) -> tuple[str, bytes] | None:
        found = self._modules.get(sha)
        if found is None and not self._builtins_indexed:
            from epick.config import BUILTIN_POLICY_DIR

            self._builtins_indexed = True
            for p in sorted(BUILTIN_POLICY_DIR.glob("*.wasm")):
                data = p.read_bytes()
                self._modules.setdefault(hashlib.sha256(data).hexdigest(), (p.stem, data))
            found = self._modules.get(sha)
        return found

    def _policies(self, buf: bytearray, policies) -> int:
        if policies is self._written_policies:
            return self._policies_id
        refs = []
        for e in policies.entries:
            module = getattr(e.plugin, "module", None)
            sha = getattr(module, "sha256", "")
            if sha and self.embed_modules and sha not in self._written_modules:
                found = self._module_bytes(sha)
                if found is not None:
                    self._frame(buf, schema.Module(sha256=sha, name=found[0], wasm=found[1]))
                self._written_modules.add(sha)
            refs.append(schema.PolicyRef(
                name=e.name, sha256=sha, weight=float(e.weight), shadow=e.shadow,
                params=dict(getattr(e.plugin, "params", {}) or {}),
                module_name=getattr(module, "name", ""),
            ))
        self._policies_id += 1
        self._frame(buf, schema.Policies(id=self._policies_id, entries=tuple(refs)))
        self._written_policies = policies
        return self._policies_id

    def _marks(self, buf: bytearray, policies, marks) -> None:
        """Checkpoint and Recovered records for what changed since the previous record.

        Checkpoints run between picks (the service's background task), recoveries inside
        a call: so a checkpoint goes before the record that noticed it, and so does a
        recovery (the replay re-creates the instance before that decision's calls).
        """
        seen = self._seen_marks
        for e, (recoveries, checkpoints) in zip(policies.entries, marks):
            was_r, was_c = seen.get(e.plugin, (0, 0))
            if checkpoints != was_c:
                self._frame(buf, schema.Checkpoint(policy=e.name))
            if recoveries != was_r:
                self._frame(buf, schema.Recovered(policy=e.name, recoveries=recoveries))
            seen[e.plugin] = (recoveries, checkpoints)

    def _snapshot(self, buf: bytearray, view) -> None:
        if view is self._written_view or view.version in self._written_versions:
            return
        self._frame(buf, schema.SnapshotRec(
            version=view.version, encoded=view.encoded,
            facts=tuple(schema.EndpointFacts(
                fresh=i.fresh,
                models=tuple(sorted(i.models)) if i.models is not None else None,
                adapters=tuple(sorted(i.adapters)) if i.adapters is not None else None,
            ) for i in view.info),
        ))
        self._written_view = view
        self._written_versions.add(view.version)

    def _features(self, req: abi.Request) -> schema.RequestFeatures:
        prompt = req.prompt
        blocks = b""
        text = None
        if self.prompt == "hashes":
            blocks = features.pack_hashes(features.block_hashes(
                req.model, req.cache_salt, prompt, self.block_bytes, self.max_blocks))
        elif self.prompt == "full":
            text = prompt
        headers = {}
        if self.headers and req.headers:
            lowered = {k.lower(): v for k, v in req.headers.items()}
            headers = {k: lowered[k] for k in self.headers if k in lowered}
        return schema.RequestFeatures(
            request_id=req.request_id, model=req.model, adapter=req.adapter,
            criticality=int(req.criticality), seed=req.seed, cache_salt=req.cache_salt,
            headers=headers, prompt_bytes=len(prompt.encode()) if prompt else 0,
            blocks=blocks, prompt=text, slo_ttft_ms=req.slo_ttft_ms,
            slo_tpot_ms=req.slo_tpot_ms, prompt_tokens=req.prompt_tokens,
            session_id=req.session_id,
        )

    def _encode_decision(self, buf: bytearray, item) -> None:
        (decision, request, view, now_ms, policies, candidates, scores, shadow_scores,
         picked, marks, (in_flight, since), (prefix_blocks, prefix_matched),
         prefix_cleared_ms) = item
        if not self._header_written:
            self._header(buf, decision.decision_id, first_is_decision=True)
        pid = self._policies(buf, policies)
        self._marks(buf, policies, marks)
        self._snapshot(buf, view)
        packed = {name: np.asarray(s, dtype="<f4").tobytes() for name, s in scores.items()}
        for name, s in shadow_scores.items():
            packed[name] = np.asarray(s, dtype="<f4").tobytes()
        self._frame(buf, schema.DecisionRec(
            id=decision.decision_id, t_ms=now_ms, snapshot=view.version, policies=pid,
            request=self._features(request), candidates=tuple(candidates), scores=packed,
            picked=tuple(picked), skipped=tuple(decision.skipped),
            in_flight=in_flight, picked_since_scrape=since,
            prefix_blocks=prefix_blocks, prefix_matched=prefix_matched,
            prefix_cleared_ms=prefix_cleared_ms,
        ))

    def _encode_completion(self, buf: bytearray, item) -> None:
        (decision_id, event, endpoint, prompt_tokens, completion_tokens, ttft_s, policies,
         marks) = item
        if not self._header_written:
            self._header(buf, decision_id, first_is_decision=False)
        if policies is not None:
            self._marks(buf, policies, marks)
        self._frame(buf, schema.CompletionRec(
            id=decision_id, t_ms=event.timestamp_ms, status=int(event.status),
            endpoint=endpoint, prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens, ttft_s=ttft_s,
        ))
