"""Prometheus view of the KV-event subscribers, read at scrape time (no per-frame cost).

``epick_kv_frames_total``, ``epick_kv_bad_frames_total``, ``epick_kv_gaps_total``,
``epick_kv_replays_total``, ``epick_kv_replay_failures_total``,
``epick_kv_restarts_total`` and the gauge ``epick_kv_index_blocks``, each per
``endpoint``. :data:`KV_STATS` ``.source`` is set by the service that runs subscribers.
"""

from __future__ import annotations

from collections.abc import Callable

from epick import telemetry

__all__ = ["KV_STATS"]

_COUNTERS = (
    ("frames", "Frames received from the endpoint's KV-event publisher (live and replayed)."),
    ("bad_frames", "KV-event frames refused (wrong parts, sequence, topic or payload)."),
    ("gaps", "Sequence gaps in the endpoint's KV events."),
    ("replays", "Replay requests sent to the endpoint's replay socket."),
    ("replay_failures", "Replay requests that failed or timed out."),
    ("restarts", "Engine restarts seen (the event sequence went back)."),
)


class _KvStats:
    def __init__(self) -> None:
        self.source: Callable[[], tuple[dict, object]] | None = None

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        fams = {name: CounterMetricFamily(f"epick_kv_{name}", doc, labels=["endpoint"])
                for name, doc in _COUNTERS}
        blocks = GaugeMetricFamily("epick_kv_index_blocks", "Blocks the index holds for the "
                                   "endpoint (from its KV events).", labels=["endpoint"])
        if self.source is not None:
            stats, index = self.source()
            for address, st in list(stats.items()):
                for name, fam in fams.items():
                    fam.add_metric([address], getattr(st, name))
                blocks.add_metric([address], index.size(address))
        return [*fams.values(), blocks]


KV_STATS = _KvStats()
telemetry.REGISTRY.register(KV_STATS)
