"""The per-pick score frame of ABI v2 (policies/ABI.md, "The score frame"), encoded once.

Every version 2 policy of a pick gets the same bytes (with its snapshot inline or not),
so the frame is made once per cycle, candidates and snapshot mode, and kept here: a
one-entry cache keyed by the identity of the :class:`~epick.interfaces.Cycle` and of its
candidates tuple (every policy of a pick gets the same tuple). The values are the
cycle's own per-candidate caches, so the decision log records what the policies saw.
"""

from __future__ import annotations

from collections.abc import Callable

from epick import abi
from epick.interfaces import Cycle

__all__ = ["frame_for", "ARRAY_SOURCES"]


def _in_flight(cycle: Cycle, c: tuple[int, ...]) -> tuple[int, ...]:
    return cycle.assigned(c)[0]


def _since(cycle: Cycle, c: tuple[int, ...]) -> tuple[int, ...]:
    return cycle.assigned(c)[1]


def _blocks(cycle: Cycle, c: tuple[int, ...]) -> tuple[int, ...]:
    return cycle.kv_counts(c)[0]


def _matched(cycle: Cycle, c: tuple[int, ...]) -> tuple[int, ...]:
    return cycle.kv_counts(c)[1]


#: Where each per-candidate array of the frame comes from, in :data:`abi.FRAME_ARRAYS`
#: order (an appended ScoreInput field fails the check below until it is added here).
ARRAY_SOURCES: dict[str, Callable[[Cycle, tuple[int, ...]], tuple[int, ...]]] = {
    "in_flight": _in_flight,
    "picked_since_scrape": _since,
    "prefix_blocks": _blocks,
    "prefix_matched": _matched,
    "prefix_cleared_ms": Cycle.kv_cleared,
    "uncached_tokens": Cycle.uncached_tokens,
}
if tuple(ARRAY_SOURCES) != abi.FRAME_ARRAYS or len(abi.FRAME_ARRAYS) != 6:  # pragma: no cover
    # an appended ScoreInput array needs a source here, and a slot in frame_for's fast path
    raise ImportError(f"frame arrays {tuple(ARRAY_SOURCES)} != ScoreInput's {abi.FRAME_ARRAYS}")

_SOURCES = tuple(ARRAY_SOURCES.values())
_encode = abi.encoder.encode
# (cycle, candidates, request bytes, {inline_snapshot: frame}) of the last pick.
_last: tuple[object, object, bytes, dict[bool, bytes]] = (None, None, b"", {})
# (candidates tuple, its packed bytes): kept while the tuple lives (it is held here).
_packed: tuple[object, bytes] = (None, b"")
_by_value: dict[tuple[int, ...], bytes] = {}


def frame_for(cycle: Cycle, candidates: tuple[int, ...], *, inline_snapshot: bool) -> bytes:
    """The frame for ``candidates`` of ``cycle`` (cached for the pick's other policies)."""
    global _last
    last = _last
    if last[0] is cycle:
        if last[1] is candidates:
            got = last[3].get(inline_snapshot)
            if got is not None:
                return got
            frames = last[3]
        else:
            frames = {}
        request = last[2]
    else:
        request = _encode(cycle.request)
        frames = {}
    global _packed
    packed = _packed
    if packed[0] is not candidates:
        # Picks on one pool mostly have the same candidates (a new tuple each time):
        # hashing it costs a fraction of packing it.
        got = _by_value.get(candidates)
        if got is None:
            if len(_by_value) >= 16:
                _by_value.clear()
            got = _by_value[candidates] = abi.pack_candidates(candidates)
        packed = _packed = (candidates, got)
    if cycle.kv is None:  # KV events off: only the assignment counts (the usual case)
        in_flight, since = cycle.assigned(candidates)
        arrays = (in_flight, since, (), (), (), ())
    else:
        arrays = tuple(src(cycle, candidates) for src in _SOURCES)
    frame = abi.encode_frame(
        request, cycle.view.encoded if inline_snapshot else None, candidates, arrays,
        packed=packed[1])
    frames[inline_snapshot] = frame
    _last = (cycle, candidates, request, frames)
    return frame


def forget() -> None:
    """Drop the cached frame (tests; a closed scheduler)."""
    global _last, _packed
    _last = (None, None, b"", {})
    _packed = (None, b"")
    _by_value.clear()
