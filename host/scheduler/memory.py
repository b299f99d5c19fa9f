"""Decision memory: what was picked, until the gateway reports the request finished.

A decision is remembered under its id (and its request id, when the request had one)
for ``ttl_s``, at most ``max_decisions`` at a time; the oldest go first. A completion
report takes the record out (once: a second report finds nothing), and so does expiry.
Touched only from the scheduler's thread.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec

__all__ = ["DecisionMemory", "Remembered"]


class Remembered(msgspec.Struct):
    """One decision awaiting its completion report. (A struct: made once per pick, where
    a dataclass's ``__init__`` is a Python call.)"""

    request_id: str
    model: str
    adapter: str
    endpoint: str
    """The picked endpoint: the one whose counts and history the pick raised."""
    expires: float


class DecisionMemory:
    """Bounded in count (``max_decisions``) and age (``ttl_s`` on ``clock``).

    ``on_expire(endpoint)`` is called for each decision dropped unreported (the scheduler
    lowers that endpoint's in-flight count).
    """

    def __init__(self, *, ttl_s: float = 600.0, max_decisions: int = 100_000,
                 clock: Callable[[], float] = time.monotonic,
                 on_expire: Callable[[str], None] = lambda endpoint: None) -> None:
        self.ttl_s = ttl_s
        self.max_decisions = max_decisions
        self._clock = clock
        self._on_expire = on_expire
        self._pending: OrderedDict[str, Remembered] = OrderedDict()
        self._by_request: dict[str, str] = {}
        self._ids = itertools.count(1)
        # Ids are unique across restarts too: a late report to a new process is unknown.
        self._boot = os.urandom(4).hex()
        # No decision expires before _check_at (see _expire).
        self._check_at = float("-inf")
        self._last_expires = float("-inf")
        self._in_order = True

    def remember(self, request_id: str, model: str, adapter: str, endpoint: str) -> str:
        """A new decision's id (expired and surplus ones are dropped first)."""
        now = self._clock()
        pending = self._pending
        if now >= self._check_at or len(pending) >= self.max_decisions:
            self._expire(now)
        expires = now + self.ttl_s
        if expires < self._last_expires:  # the clock went back: expiries are not in order
            self._in_order = False
            self._check_at = float("-inf")
        self._last_expires = expires
        decision_id = f"{self._boot}-{next(self._ids):x}"
        pending[decision_id] = Remembered(request_id, model, adapter, endpoint, expires)
        if request_id:
            self._by_request[request_id] = decision_id
        return decision_id

    def _expire(self, now: float) -> None:
        """Drop the oldest decisions while they are expired or too many; then note when
        the oldest left expires, so that the picks before it skip this (while expiries
        come in the order of the decisions, none expires sooner; after a clock that
        went back, every pick looks)."""
        pending = self._pending
        while pending:
            oldest_id, oldest = next(iter(pending.items()))
            if oldest.expires > now and len(pending) < self.max_decisions:
                self._check_at = oldest.expires if self._in_order else float("-inf")
                return
            pending.popitem(last=False)
            self._on_expire(oldest.endpoint)
            if oldest.request_id and self._by_request.get(oldest.request_id) == oldest_id:
                del self._by_request[oldest.request_id]
        self._check_at = float("-inf")

    def take(self, decision_id: str = "", request_id: str = "") -> tuple[str, Remembered] | None:
        """``(decision_id, record)`` of a decision, forgotten now; ``None`` when unknown.

        ``decision_id`` wins; without it the request id finds the decision."""
        if not decision_id and request_id:
            decision_id = self._by_request.get(request_id, "")
        rec = self._pending.pop(decision_id, None) if decision_id else None
        if rec is None:
            return None
        if rec.request_id and self._by_request.get(rec.request_id) == decision_id:
            del self._by_request[rec.request_id]
        return decision_id, rec

    def __len__(self) -> int:
        return len(self._pending)
