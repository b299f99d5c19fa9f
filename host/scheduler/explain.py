"""The ``explain`` view of a decision, and the words for an UNAVAILABLE answer.

Read-only helpers of the scheduler: they turn a finished cycle (candidates, totals,
per-policy scores, the picker's order, who filtered what) and the pool's scrape status
into rows a person can read. Nothing here changes a pick.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from epick import abi
from epick.interfaces import PoolView
from epick.scheduler.filters import FreshFilter

__all__ = ["CandidateScore", "explain", "add_scrape_reasons", "unavailable_reason",
           "scrape_errors"]


@dataclass(slots=True)
class CandidateScore:
    """One endpoint's part in a decision (the ``explain`` view)."""

    endpoint: str
    total: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)
    filtered_by: str = ""
    rank: int = -1
    shadow_scores: dict[str, float] = field(default_factory=dict)
    in_flight: int = 0
    picked_since_scrape: int = 0
    reason: str = ""
    """Why it is not a candidate, in words, beyond the filter's name (no metrics, stale)."""
    prefix_blocks: int | None = None
    prefix_matched: int | None = None
    """KV blocks of the request / held per the endpoint's events (None = KV events off)."""


def explain(endpoints, candidates, totals, per_policy, order, why,
            shadow_scores) -> list[CandidateScore]:
    """One row per endpoint of the snapshot, candidates with their scores and rank."""
    pos_of = {c: p for p, c in enumerate(candidates)}
    rank_of = {o: r for r, o in enumerate(order)}
    out = []
    for i, ep in enumerate(endpoints):
        row = CandidateScore(endpoint=ep.address, filtered_by=why.get(i, ""))
        p = pos_of.get(i)
        if p is not None:
            row.total = float(totals[p])
            row.scores = {name: float(s[p]) for name, s in per_policy.items()}
            row.shadow_scores = {name: float(s[p]) for name, s in shadow_scores.items()}
            row.rank = rank_of.get(p, -1)
        out.append(row)
    return out


def add_scrape_reasons(rows: list[CandidateScore], status: Sequence) -> None:
    """Rows for configured endpoints the snapshot lacks (never scraped successfully), and
    the scrape's story for stale ones: an endpoint never silently vanishes from a view."""
    by_address = {row.endpoint: row for row in rows}
    for st in status:
        row = by_address.get(st.address)
        error = f"; last error: {st.last_error}" if st.last_error else ""
        if row is None:
            rows.append(CandidateScore(
                endpoint=st.address, filtered_by="no-metrics",
                reason=(f"no good scrape of {st.url} yet{error}" if st.last_error
                        else f"not scraped yet ({st.url})"),
            ))
        elif row.filtered_by == FreshFilter.name and st.last_success_age_ms is not None:
            row.reason = (f"metrics are stale: the last good scrape of {st.url} was "
                          f"{st.last_success_age_ms / 1000:.1f} s ago{error}")


def scrape_errors(status: Sequence | None, limit: int = 3) -> str:
    """The pool's latest scrape errors, for an UNAVAILABLE answer: '' when none."""
    if status is None:
        return ""
    errors = [f"{st.address}: {st.last_error}" for st in status
              if st.last_error and not st.fresh]
    if not errors:
        return ""
    more = f"; and {len(errors) - limit} more" if len(errors) > limit else ""
    return f" (last scrape errors: {'; '.join(errors[:limit])}{more})"


def unavailable_reason(view: PoolView, request: abi.Request) -> str:
    """Why no endpoint is left after the host filters, in words."""
    if not view.snapshot.endpoints:
        return "no endpoint has reported metrics yet"
    if not any(i.fresh for i in view.info):
        return "no endpoint has fresh metrics (all stale)"
    live = [i for i in view.info if i.fresh and not i.sleeping]
    if not live:
        return "every endpoint with fresh metrics is asleep"
    what = f"model {request.model!r}"
    if request.adapter:
        what += f" with adapter {request.adapter!r}"
    return f"no fresh endpoint serves {what}; {_served(live)}"


def _served(live) -> str:
    """What the fresh, awake endpoints serve, for an UNAVAILABLE message."""

    def names(sets) -> str:
        known = sorted(set().union(*(x for x in sets if x is not None)))
        text = ", ".join(known) if known else "(none)"
        if any(x is None for x in sets):
            text += " (and endpoints that do not say)"
        return text

    return (f"the fleet serves models: {names([i.models for i in live])}; "
            f"adapters: {names([i.adapters for i in live])}")
