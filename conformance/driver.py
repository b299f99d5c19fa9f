"""Feeding one policy instance the way the host does — the only module that touches the runtime.

The host delivers a snapshot with ``set_snapshot`` when the policy exports it and then
passes ``ScoreInput.snapshot = nil``; otherwise it inlines the snapshot in every
``ScoreInput``. The conformance runner does the same, so a vector exercises the path the
policy will really take. An *earlier* snapshot (a vector's ``before`` event) reaches a
policy without ``set_snapshot`` as a ``score``/``filter`` call over every endpoint whose
output is discarded — the only way such a policy ever sees a snapshot.
"""

from __future__ import annotations

import numpy as np

from epick import abi

__all__ = ["Driver", "exports"]

_encode = abi.encoder.encode


def exports(instance) -> frozenset[str]:
    """The ABI exports ``instance``'s module provides (``score``, ``set_snapshot``…)."""
    return frozenset(instance.exports)


class Driver:
    """One policy instance plus the host's delivery rules; see the module docstring."""

    def __init__(self, instance) -> None:
        self.instance = instance
        names = exports(instance)
        self.resident = "set_snapshot" in names
        self.can_score = "score" in names
        self.can_filter = "filter" in names
        self._snapshot: abi.Snapshot | None = None

    def snapshot(self, snap: abi.Snapshot) -> None:
        """Deliver ``snap`` now (``set_snapshot``, or a discarded call over all endpoints)."""
        self._snapshot = snap
        if self.resident:
            self.instance.set_snapshot(_encode(snap))
            return
        everyone = tuple(range(len(snap.endpoints)))
        blob = _encode(abi.ScoreInput(snapshot=snap, request=abi.Request(), candidates=everyone))
        if self.can_score:
            self.instance.score(blob, len(everyone))
        else:
            self.instance.filter(blob, len(everyone))

    def score_input(self, snap: abi.Snapshot, request: abi.Request, candidates) -> bytes:
        """The ``ScoreInput`` bytes for ``snap`` — delivering it first when resident."""
        candidates = tuple(candidates)
        if self.resident:
            if self._snapshot is not snap:
                self.snapshot(snap)
            return _encode(abi.ScoreInput(snapshot=None, request=request, candidates=candidates))
        self._snapshot = snap
        return _encode(abi.ScoreInput(snapshot=snap, request=request, candidates=candidates))

    def score(self, snap: abi.Snapshot, request: abi.Request, candidates) -> np.ndarray:
        candidates = tuple(candidates)
        blob = self.score_input(snap, request, candidates)
        return np.asarray(self.instance.score(blob, len(candidates)), dtype=np.float64)

    def filter(self, snap: abi.Snapshot, request: abi.Request, candidates) -> np.ndarray:
        candidates = tuple(candidates)
        blob = self.score_input(snap, request, candidates)
        return np.asarray(self.instance.filter(blob, len(candidates)), dtype=bool)

    def pre_request(self, event: abi.PreRequestEvent) -> None:
        self.instance.pre_request(_encode(event))

    def post_response(self, event: abi.PostResponseEvent) -> None:
        self.instance.post_response(_encode(event))
