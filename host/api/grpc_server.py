"""Options every epick grpc.aio server is built with (the Pick API, ext_proc).

gRPC Core accepts a call (HTTP/2 HEADERS) on its own threads, then holds it until the
application asks for the next call; the asyncio server asks for one call at a time, from
its event loop. While that loop is busy (thousands of ext_proc streams and their chunks),
accepted calls pile up in Core, which drops them two ways, each seen by the client as its
stream ending at once (Envoy: ext_proc ``streams_failed``, a 503 with no body, and nothing
in epick's log):

- past ``grpc.server.max_pending_requests`` (default 1,000) Core refuses new calls at
  random, all of them past the hard limit (default 3,000). That was issue 31's loss at
  2,000 concurrent Envoy streams on one process;
- a call left waiting longer than ``grpc.server_max_unrequested_time_in_server`` (default
  30 s) is cancelled when the loop next asks for a call. In FULL_DUPLEX_STREAMED mode
  Envoy runs no message timer, so at 2,000 concurrent streamed requests, where they
  waited 25 s at the median, Core's 30 s was the first deadline to fire: 89 and 309
  ``streams_failed`` in two runs, with a p99 of 36-38 s (docs/performance.md).

The loop takes every waiting call once it turns, so both are raised: the count to the
example Envoy configs' circuit breakers (``max_requests: 100000`` on the ext_proc
cluster), the wait above every wait Envoy bounds itself (the examples' 30 s
``message_timeout`` in BUFFERED mode, 300 s ``stream_idle_timeout``): Envoy bounds the
streams and how long they wait, with its own counters (``message_timeouts``) and answers.
"""

from __future__ import annotations

__all__ = ["MAX_PENDING_CALLS", "MAX_UNREQUESTED_S", "PENDING_CALLS_OPTIONS"]

#: Calls gRPC Core may hold before the server's loop takes them (soft and hard limit).
MAX_PENDING_CALLS = 100_000
#: Seconds gRPC Core holds a call the loop has not taken yet before cancelling it.
MAX_UNREQUESTED_S = 3_600

PENDING_CALLS_OPTIONS: list[tuple[str, int]] = [
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
    ("grpc.server_max_unrequested_time_in_server", MAX_UNREQUESTED_S),
]
