"""Token usage and first-token time, read from an OpenAI answer as it streams past.

Both gateways (``epick.api.ext_proc``, ``epick.gateway``) feed every response body chunk
to a :class:`UsageReader` and report what it found in ReportCompletion:

- ``text/event-stream`` (``"stream": true``): the first chunk is the first token (TTFT);
  usage comes from any ``data:`` event carrying a ``usage`` object (vLLM sends it in the
  last event when the request set ``stream_options.include_usage``; with
  ``continuous_usage_stats`` in every event — the last one wins). Only lines that mention
  ``"usage"`` are decoded, so a chunk of whole events costs one substring search and no
  copy (``epick bench ext-proc-chunk`` measures it).
- ``application/json``: the whole body is decoded at the end (up to ``limit`` bytes; a
  larger one is passed through unread) and ``usage`` read from it. No TTFT: the answer
  arrives at once.

Anything else (an error page, another type) is passed through and yields nothing. The
reader never raises on what the backend sent: bad JSON just means no usage.
"""

from __future__ import annotations

import json

__all__ = ["UsageReader", "tokens_from"]

#: A partial SSE line longer than this is dropped (a line is one event; vLLM's are small).
MAX_LINE_BYTES = 1 << 20


def _tokens(usage: object) -> tuple[int | None, int | None]:
    if not isinstance(usage, dict):
        return None, None
    out = []
    for key in ("prompt_tokens", "completion_tokens"):
        v = usage.get(key)
        out.append(v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None)
    return out[0], out[1]


class UsageReader:
    """Feed it the response's chunks (``feed``), then call ``finish`` once at the end.

    ``started`` is when the request was received (``time.perf_counter`` seconds): TTFT is
    measured from it.
    """

    __slots__ = ("sse", "json", "started", "limit", "prompt_tokens", "completion_tokens",
                 "ttft_s", "_tail", "_parts", "_size")

    def __init__(self, content_type: str, started: float, *, limit: int = 4 << 20) -> None:
        ctype = content_type.split(";", 1)[0].strip().lower()
        self.sse = ctype == "text/event-stream"
        self.json = ctype == "application/json"
        self.started = started
        self.limit = limit
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.ttft_s: float | None = None
        self._tail = b""
        self._parts: list[bytes] | None = [] if self.json else None
        self._size = 0

    def feed(self, chunk: bytes, now: float) -> None:
        if not chunk:
            return
        if self.sse:
            if self.ttft_s is None:
                self.ttft_s = max(0.0, now - self.started)
            self._feed_sse(chunk)
        elif self._parts is not None:
            self._size += len(chunk)
            if self._size > self.limit:
                self._parts = None  # too large to read: pass it through unread
            else:
                self._parts.append(chunk)

    def _feed_sse(self, chunk: bytes) -> None:
        # Per chunk, only what usage needs: one substring search, no copy. The common
        # case is whole events per chunk (vLLM writes an event at a time).
        if not self._tail and chunk.endswith(b"\n"):
            if b'"usage"' in chunk:
                self._lines(chunk)
            return
        data = self._tail + chunk if self._tail else chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            self._tail = data if len(data) <= MAX_LINE_BYTES else b""
            return
        self._tail = data[cut + 1:]
        if data.find(b'"usage"', 0, cut) >= 0:
            self._lines(data[:cut])

    def _lines(self, complete: bytes) -> None:
        for line in complete.split(b"\n"):
            if line.startswith(b"data:") and b'"usage"' in line:
                self._event(line[5:])

    def _event(self, payload: bytes) -> None:
        try:
            doc = json.loads(payload)
        except ValueError:
            return
        if isinstance(doc, dict):
            prompt, completion = _tokens(doc.get("usage"))
            if prompt is not None or completion is not None:
                self.prompt_tokens, self.completion_tokens = prompt, completion

    def finish(self) -> None:
        """The body ended: read what was held back (a JSON body, a last unterminated line)."""
        if self.sse and self._tail:
            tail, self._tail = self._tail, b""
            if tail.startswith(b"data:") and b'"usage"' in tail:
                self._event(tail[5:])
        if self._parts:
            parts, self._parts = self._parts, None
            try:
                doc = json.loads(b"".join(parts))
            except ValueError:
                return
            if isinstance(doc, dict):
                self.prompt_tokens, self.completion_tokens = _tokens(doc.get("usage"))


def tokens_from(kind: str, parts: list[bytes]) -> tuple[int | None, int | None]:
    """``(prompt_tokens, completion_tokens)`` from what a native front-end worker kept of
    an answer, read with :class:`UsageReader`'s rules: ``kind`` ``"sse"``, ``parts`` the
    payloads after ``data:`` of the lines naming ``"usage"`` (the last good one wins);
    ``"json"``, ``parts`` the whole body."""
    reader = UsageReader("application/json" if kind == "json" else "", 0.0,
                         limit=1 << 62)
    if kind == "json":
        for part in parts:
            reader.feed(part, 0.0)
        reader.finish()
    else:
        for payload in parts:
            reader._event(payload)
    return reader.prompt_tokens, reader.completion_tokens
