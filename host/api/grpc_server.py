"""Options every epick grpc.aio server is built with (the Pick API, ext_proc).

gRPC Core accepts a call (HTTP/2 HEADERS) on its own threads, then holds it until the
application asks for the next call; the asyncio server asks for one call at a time, from
its event loop. While that loop is busy (thousands of ext_proc streams and their chunks),
accepted calls pile up in Core, and past ``grpc.server.max_pending_requests`` (default
1,000) Core refuses new ones at random, all of them past the hard limit (default 3,000):
the client sees its stream end at once (Envoy: ext_proc ``streams_failed``, a 503 with no
body). That was issue 31's loss at 2,000 concurrent Envoy streams on one process
(docs/performance.md). The loop takes every waiting call once it turns, so the limits are
raised to the example Envoy configs' circuit breakers (``max_requests: 100000`` on the
ext_proc cluster): Envoy bounds the streams, its ``message_timeout`` bounds their wait.
"""

from __future__ import annotations

__all__ = ["MAX_PENDING_CALLS", "PENDING_CALLS_OPTIONS"]

#: Calls gRPC Core may hold before the server's loop takes them (soft and hard limit).
MAX_PENDING_CALLS = 100_000

PENDING_CALLS_OPTIONS: list[tuple[str, int]] = [
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
]
