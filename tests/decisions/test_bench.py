"""`epick bench decisions` measures all three variants on the same stream."""

from __future__ import annotations

from epick.bench.decisions import VARIANTS, run


def test_the_bench_times_every_variant_and_replays_its_logs_exactly(tmp_path):
    res = run(endpoints=4, rounds=2, per_round=30, snapshot_every=5, folder=tmp_path)
    assert set(res["variants"]) == set(VARIANTS)
    for name in ("log", "log-raw"):
        v = res["variants"][name]
        assert v["written"] == {"decision": 60, "completion": 60}
        assert v["dropped"] == {"queue-full": 0, "write-error": 0}
        assert v["replay_agreement"] == 1.0 and v["bytes_per_1000"] > 0
    assert res["variants"]["log"]["bytes"] < res["variants"]["log-raw"]["bytes"]
