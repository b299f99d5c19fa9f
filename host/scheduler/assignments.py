"""What the host sent where: the load signal that no scrape can be late for.

Per endpoint address, two counts (the llm-d router and SGLang's router keep the same):

- ``in_flight``: requests picked for it and not yet completed — down on ReportCompletion
  (or the ext_proc stream's end), or when the decision expires unreported;
- ``picked_since_scrape``: picks for it since its last good scrape, i.e. work its
  metrics cannot show yet. The pool resets it on every good scrape.

Both reach policies in ``ScoreInput`` (policies/ABI.md) so that a replica that was just
given work stops looking idle before the next scrape (the herding the issue measured).
Touched only from the event-loop thread, like the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import Protocol

__all__ = ["Assignments", "Ledger"]


class Ledger(Protocol):
    """What the scheduler reads and writes of the counts (:class:`Assignments`
    implements it; a replay gives the counts the log recorded)."""

    def of(self, addresses: Sequence[str]) -> tuple[tuple[int, ...], tuple[int, ...]]: ...

    def picked(self, address: str) -> None: ...

    def completed(self, address: str) -> None: ...

    def in_flight(self, address: str) -> int: ...

    def picked_since_scrape(self, address: str) -> int: ...

    def __bool__(self) -> bool: ...


class Assignments:
    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}
        self._since: dict[str, int] = {}
        # The counts of the last addresses asked for, kept current by every change, so a
        # pick reading the same addresses again (the view's tuple: every pick until the
        # next scrape) copies two lists instead of making 2 × N dict lookups:
        # (addresses, index of each address, in_flight per address, since per address).
        self._rows: tuple[Sequence[str], dict[str, int], list[int], list[int]] | None = None
        self._asked: Sequence[str] | None = None

    def picked(self, address: str) -> None:
        self._in_flight[address] = self._in_flight.get(address, 0) + 1
        self._since[address] = self._since.get(address, 0) + 1
        rows = self._rows
        if rows is not None:
            i = rows[1].get(address)
            if i is not None:
                rows[2][i] += 1
                rows[3][i] += 1

    def completed(self, address: str) -> None:
        """One of its requests ended (never below 0: a duplicate report is harmless)."""
        n = self._in_flight.get(address, 0)
        if n > 1:
            self._in_flight[address] = n - 1
        else:
            self._in_flight.pop(address, None)
        self._set(address, 2, self._in_flight.get(address, 0))

    def scraped(self, address: str) -> None:
        """A good scrape of ``address``: its metrics now show what it was given."""
        self._since.pop(address, None)
        self._set(address, 3, 0)

    def forget(self, address: str) -> None:
        self._in_flight.pop(address, None)
        self._since.pop(address, None)
        self._set(address, 2, 0)
        self._set(address, 3, 0)

    def in_flight(self, address: str) -> int:
        return self._in_flight.get(address, 0)

    def picked_since_scrape(self, address: str) -> int:
        return self._since.get(address, 0)

    def of(self, addresses: Sequence[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(in_flight, picked_since_scrape)`` for these addresses; both empty when
        nothing is assigned. Both are given together, so a policy can tell "0 in flight"
        from "no count sent" (``ctx.work`` does)."""
        inf, since = self._in_flight, self._since
        if not inf and not since:
            return (), ()
        rows = self._rows
        if rows is not None and rows[0] is addresses:
            return tuple(rows[2]), tuple(rows[3])
        # map() with a second iterable calls get(x, 0) from C: 3x a generator's speed.
        in_flight = tuple(map(inf.get, addresses, repeat(0)))
        picked = tuple(map(since.get, addresses, repeat(0)))
        if addresses is self._asked:  # asked twice in a row: worth keeping current
            index = {address: i for i, address in enumerate(addresses)}
            # A repeated address would need two rows kept current: not kept.
            self._rows = (addresses, index, list(in_flight), list(picked)) \
                if len(index) == len(addresses) else None
        self._asked = addresses
        return in_flight, picked

    def _set(self, address: str, column: int, value: int) -> None:
        rows = self._rows
        if rows is not None:
            i = rows[1].get(address)
            if i is not None:
                rows[column][i] = value

    def __bool__(self) -> bool:
        return bool(self._in_flight or self._since)
