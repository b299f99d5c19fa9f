"""Feeding one policy instance the way the host does — the only module that touches the runtime.

The host delivers a snapshot with ``set_snapshot`` when the policy exports it and then
passes ``ScoreInput.snapshot = nil``; otherwise it inlines the snapshot in every
``ScoreInput``. The conformance runner does the same, so a vector exercises the path the
policy will really take. An *earlier* snapshot (a vector's ``before`` event) reaches a
policy without ``set_snapshot`` as a ``score``/``filter`` call over every endpoint whose
output is discarded — the only way such a policy ever sees a snapshot.
"""

from __future__ import annotations

import msgspec
import numpy as np

from epick import abi
from epick.runtime.errors import PolicyTimeout

__all__ = ["Driver", "exports", "encode", "encode_with_future_fields", "FUTURE_FIELDS"]

encode = abi.encoder.encode

#: Trailing elements a later ABI version might append to every payload array: one of
#: each msgpack type, nested ones included. A conforming policy skips them.
FUTURE_FIELDS: tuple = ("future-field", 42, -7, 1.5, True, None, [1, "x", [2]], {"k": {"v": 1}}, b"\x00\xff")


def _with_future_fields(obj):
    if isinstance(obj, msgspec.Struct):
        fields = [_with_future_fields(getattr(obj, f)) for f in obj.__struct_fields__]
        return fields + list(FUTURE_FIELDS)
    if isinstance(obj, (tuple, list)):
        return [_with_future_fields(x) for x in obj]
    return obj


def encode_with_future_fields(payload: msgspec.Struct) -> bytes:
    """``payload`` encoded with :data:`FUTURE_FIELDS` appended to every array in it."""
    return encode(_with_future_fields(payload))


def exports(instance) -> frozenset[str]:
    """The ABI exports ``instance``'s module provides (``score``, ``set_snapshot``…)."""
    return frozenset(instance.exports)


class Driver:
    """One policy instance plus the host's delivery rules; see the module docstring."""

    def __init__(
        self,
        instance,
        *,
        encode=encode,
        inline: bool = False,
        use: str | None = None,
        timeout_retries: int = 2,
        carry: bool = True,
    ) -> None:
        """``encode`` turns payload Structs into bytes; ``inline=True`` never uses
        ``set_snapshot`` (to compare both delivery paths); ``use`` is the export
        :meth:`call` makes (default ``score`` when exported, else ``filter``);
        ``timeout_retries``: see :meth:`_call`; ``carry``: see ``carry_events``."""
        self.instance = instance
        self.timeout_retries = timeout_retries
        self.timeouts = 0
        self.calls = 0
        """Calls made into the instance (retries included)."""
        """Calls that hit the deadline and were retried (or finally raised)."""
        self._encode = encode
        names = exports(instance)
        self.resident = "set_snapshot" in names and not inline
        self.can_score = "score" in names
        self.can_filter = "filter" in names
        self.has_pre_request = "pre_request" in names
        #: A version 2 instance gets its pre_request events carried by the next call, as
        #: the host delivers them (``carry=False``: each by its own call, version 1's way).
        self.carry_events = carry and getattr(instance, "abi_version", 1) >= 2
        self.has_post_response = "post_response" in names
        self.use = use or ("score" if self.can_score else "filter")
        self._snapshot: abi.Snapshot | None = None

    def _call(self, fn, *args):
        """``fn(*args)``, retried when it hits the runtime's deadline.

        The deadline is wall-clock time: on a shared machine a call that normally takes
        a tenth of its budget can be descheduled past it. A call that times out
        ``timeout_retries + 1`` times in a row is really over budget: that one raises.
        """
        for attempt in range(self.timeout_retries + 1):
            self.calls += 1
            try:
                out = fn(*args)
            except PolicyTimeout:
                self.timeouts += 1
                if attempt == self.timeout_retries:
                    raise
                continue
            # A carried (or flushed) pre_request event that failed raises here, as its
            # own pre_request call would have (ABI v2).
            failed = getattr(self.instance, "take_deferred_failure", None)
            exc = failed() if failed is not None else None
            if exc is not None:
                raise exc
            return out
        raise AssertionError("unreachable")

    def snapshot(self, snap: abi.Snapshot) -> None:
        """Deliver ``snap`` now (``set_snapshot``, or a discarded call over all endpoints)."""
        self._snapshot = snap
        if self.resident:
            self._call(self.instance.set_snapshot, self._encode(snap))
            return
        everyone = tuple(range(len(snap.endpoints)))
        blob = self._encode(abi.ScoreInput(snapshot=snap, request=abi.Request(), candidates=everyone))
        if self.can_score:
            self._call(self.instance.score, blob, len(everyone))
        else:
            self._call(self.instance.filter, blob, len(everyone))

    def score_input(self, snap: abi.Snapshot, request: abi.Request, candidates,
                    assigned: tuple[tuple[int, ...], ...] = ((), ())) -> bytes:
        """The ``ScoreInput`` bytes for ``snap`` — delivering it first when resident.

        ``assigned`` = (in_flight, picked_since_scrape[, prefix_blocks, prefix_matched[,
        prefix_cleared_ms]]) per candidate (empty = the ABI defaults).
        """
        candidates = tuple(candidates)
        in_flight, since, blocks, matched, cleared = (*assigned, (), (), ())[:5]
        counts = {"in_flight": in_flight, "picked_since_scrape": since,
                  "prefix_blocks": blocks, "prefix_matched": matched,
                  "prefix_cleared_ms": cleared}
        if self.resident:
            if self._snapshot is not snap:
                self.snapshot(snap)
            return self._encode(abi.ScoreInput(snapshot=None, request=request,
                                               candidates=candidates, **counts))
        self._snapshot = snap
        return self._encode(abi.ScoreInput(snapshot=snap, request=request,
                                           candidates=candidates, **counts))

    def forget_snapshot(self) -> None:
        """Deliver the next snapshot again even if unchanged (after ``init`` reset it)."""
        self._snapshot = None

    def call(self, snap: abi.Snapshot, request: abi.Request, candidates,
             assigned=((), ())) -> np.ndarray:
        """The export chosen by ``use``: scores, or a keep-mask."""
        if self.use == "score":
            return self.score(snap, request, candidates, assigned)
        return self.filter(snap, request, candidates, assigned)

    def score(self, snap: abi.Snapshot, request: abi.Request, candidates,
              assigned=((), ())) -> np.ndarray:
        candidates = tuple(candidates)
        blob = self.score_input(snap, request, candidates, assigned)
        return np.asarray(self._call(self.instance.score, blob, len(candidates)), dtype=np.float64)

    def filter(self, snap: abi.Snapshot, request: abi.Request, candidates,
               assigned=((), ())) -> np.ndarray:
        candidates = tuple(candidates)
        blob = self.score_input(snap, request, candidates, assigned)
        return np.asarray(self._call(self.instance.filter, blob, len(candidates)), dtype=bool)

    def pre_request(self, event: abi.PreRequestEvent) -> None:
        """Deliver ``event`` — unless the policy does not export ``pre_request`` (the host
        would not call it either)."""
        if not self.has_pre_request:
            return
        if self.carry_events:
            # ABI v2, as the host does it: the event rides on the next score/filter call
            # (or is delivered first by any other call).
            self.instance.defer_pre_request(self._encode(event))
        else:
            self._call(self.instance.pre_request, self._encode(event))

    def post_response(self, event: abi.PostResponseEvent) -> None:
        """Deliver ``event`` if the policy exports ``post_response``."""
        if self.has_post_response:
            self._call(self.instance.post_response, self._encode(event))
