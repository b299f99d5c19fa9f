"""The decision log keeps the per-candidate KV prefix counts the policies saw, and a
replay hands the recorded counts back (the engines' events are not in the log)."""

from __future__ import annotations

import zlib

from decision_logs import record

from epick.decisions import read_file, replay, schema
from epick.scheduler.scheduler import Scheduler


class FakeCounts:
    """Stands in for epick.kv.KvRouting: deterministic counts per (prompt, endpoint)."""

    def __init__(self) -> None:
        self.calls = 0

    def counts(self, request, endpoints, candidates):
        self.calls += 1
        blocks = len(request.prompt) // 64
        matched = tuple(zlib.crc32(f"{request.prompt}|{endpoints[i].address}".encode())
                        % (blocks + 2) - 1 for i in candidates)
        return (blocks,) * len(candidates), matched

    def cleared(self, endpoints, candidates):
        return tuple(1_700_000_000_000 + 7 * i for i in candidates)


def test_records_carry_the_counts_and_replay_feeds_them_back(tmp_path, runtime, monkeypatch):
    seam = FakeCounts()
    real_init = Scheduler.__init__

    def with_kv(self, *a, **kw):  # the recording scheduler gets the seam, as the service does
        real_init(self, *a, **kw)
        self.kv = seam

    monkeypatch.setattr(Scheduler, "__init__", with_kv)
    record(runtime, tmp_path / "d.log", seconds=2.0)
    monkeypatch.setattr(Scheduler, "__init__", real_init)

    decisions = [x for x in read_file(tmp_path / "d.log") if isinstance(x, schema.DecisionRec)]
    assert decisions and seam.calls >= len(decisions)
    with_prompt = [d for d in decisions if d.prefix_blocks and d.prefix_blocks[0] > 0]
    assert with_prompt
    for d in decisions:
        assert len(d.prefix_blocks) == len(d.prefix_matched) == len(d.candidates)
        assert d.prefix_cleared_ms == tuple(1_700_000_000_000 + 7 * i for i in d.candidates)
    from epick.decisions.replay import standins

    given = []
    real_counts = standins.RecordedKv.counts

    def spy(self, request, endpoints, candidates):
        got = real_counts(self, request, endpoints, candidates)
        given.append((request.request_id, got))
        return got

    monkeypatch.setattr(standins.RecordedKv, "counts", spy)
    cleared_given = []
    real_cleared = standins.RecordedKv.cleared

    def spy_cleared(self, endpoints, candidates):
        got = real_cleared(self, endpoints, candidates)
        cleared_given.append(got)
        return got

    monkeypatch.setattr(standins.RecordedKv, "cleared", spy_cleared)
    calls_before = seam.calls
    r = replay([tmp_path / "d.log"], runtime=runtime)
    assert r.decisions == len(decisions) and r.agreement == 1.0
    assert seam.calls == calls_before  # replayed from the log, not recomputed
    recorded = {d.request.request_id: (d.prefix_blocks, d.prefix_matched) for d in decisions}
    assert given and all(recorded[rid] == got for rid, got in given)
    assert cleared_given and all(c and all(ms >= 1_700_000_000_000 for ms in c)
                                 for c in cleared_given)
