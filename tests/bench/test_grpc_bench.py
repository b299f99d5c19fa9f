"""`epick bench pick --grpc` runs every setup and phase and computes every ratio (tiny run)."""

from epick.bench import grpc as bench


def test_a_tiny_run_measures_every_setup_phase_and_ratio():
    setups = bench.measure(sizes=(2,), threads=2, streams=1, window=4, seconds=0.3, rounds=1,
                           settle_s=0.2)
    assert [(s.endpoints, s.scrape_ms) for s in setups] == [(2, 50), (2, bench.NO_SCRAPE_MS)]
    for s in setups:
        assert set(s.phases) == {"seq_noop", "seq_pick", "par_noop", "par_pick", "stream_pick"}
        assert all(ph.calls > 0 and ph.rate > 0 for ph in s.phases.values()), s.name
        assert 0 < s.phases["seq_pick"].p50 <= s.phases["seq_pick"].p99
    whats = [r.what for r in bench.ratios(setups, (2,), threads=2)]
    assert whats == [
        "Pick ÷ no-op p50, 1 client, 2 endpoints",
        "Pick ÷ no-op p99, 1 client, 2 endpoints",
        "unary Pick ÷ no-op calls/s, 2 threads, 2 endpoints",
        "PickStream ÷ unary Pick picks/s, 2 endpoints",
        "Pick p50 with ÷ without scraping, 1 client, 2 endpoints",
        "Pick p99 with ÷ without scraping, 1 client, 2 endpoints",
    ]


def test_the_pages_change_on_every_answer_as_a_busy_replicas_do():
    from epick.bench.pages import page

    assert page(3, 1, "a,b") != page(3, 2, "a,b")
    assert b'running_lora_adapters="a,b"' in page(3, 1, "a,b")
