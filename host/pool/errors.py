"""The pool's one exception: a scrape that gave no usable metrics.

    Exception
    └── ScrapeError      the model server's fault (or the network's): its /metrics page
                         could not be fetched, was not Prometheus text, lacked a required
                         metric or held an impossible value

Configuration mistakes (a bad ``EndpointSpec``) are ``ValueError`` — msgspec turns them
into a ``ValidationError`` with the path when the spec comes from a config file.
A ``ScrapeError`` never escapes :meth:`epick.pool.Pool.run`: the pool counts it, logs
it, and keeps the endpoint's last good metrics until they go stale.
"""

from __future__ import annotations

from epick.telemetry import SCRAPE_ERROR_REASONS

__all__ = ["ScrapeError", "SCRAPE_ERROR_KINDS"]

#: Values of :attr:`ScrapeError.kind` — the ``reason`` label of
#: ``epick_scrape_errors_total``, a small fixed set (declared with the metric).
SCRAPE_ERROR_KINDS = SCRAPE_ERROR_REASONS


class ScrapeError(Exception):
    """Scraping ``url`` failed; ``reason`` says how, naming the metric when one was wrong.

    ``kind`` is one of :data:`SCRAPE_ERROR_KINDS`.
    """

    def __init__(self, url: str, reason: str, *, kind: str = "parse") -> None:
        if kind not in SCRAPE_ERROR_KINDS:  # a label outside the set would leak into metrics
            raise ValueError(f"ScrapeError kind {kind!r} is not one of {SCRAPE_ERROR_KINDS}")
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason
        self.kind = kind

    def __repr__(self) -> str:
        return f"ScrapeError(url={self.url!r}, reason={self.reason!r}, kind={self.kind!r})"
