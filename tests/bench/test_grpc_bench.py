"""`epick bench pick --grpc` runs every setup and phase and computes every ratio (tiny run)."""

from epick.bench import grpc as bench


def test_a_tiny_run_measures_every_setup_phase_and_ratio():
    setups = bench.measure(sizes=(2,), threads=2, streams=1, window=4, seconds=0.3, rounds=1,
                           settle_s=0.2)
    assert [(s.endpoints, s.scrape_ms, s.scrape_in, s.floor) for s in setups] == [
        (2, 50, "process", False), (2, bench.NO_SCRAPE_MS, "process", False),
        (2, 50, "loop", False), (2, 50, "process", True)]
    for s in setups:
        assert set(s.phases) == {"seq_noop", "seq_pick", "par_noop", "par_pick", "stream_pick"}
        assert all(ph.calls > 0 and ph.rate > 0 for ph in s.phases.values()), s.name
        assert 0 < s.phases["seq_pick"].p50 <= s.phases["seq_pick"].p99
        median, mean = s.host_us["total"]
        assert 0 < median and 0 < mean
        stages = {"filter", "score", "pick", "hooks"}
        # The floor's scheduler is stubbed: its picks pass no stage at all.
        assert not stages & set(s.host_us) if s.floor else stages <= set(s.host_us), s.name
    whats = [r.what for r in bench.ratios(setups, (2,), threads=2)]
    assert whats == [
        "floor: stubbed Pick ÷ no-op p50, 1 client, 2 endpoints",
        "floor: stubbed Pick ÷ no-op p99, 1 client, 2 endpoints",
        "floor: stubbed Pick ÷ no-op calls/s, 2 threads",
        "Pick ÷ no-op p50, 1 client, 2 endpoints",
        "Pick ÷ no-op p99, 1 client, 2 endpoints",
        "unary Pick ÷ no-op calls/s, 2 threads, 2 endpoints",
        "PickStream ÷ unary Pick picks/s, 2 endpoints",
        "Pick p50 with ÷ without scraping, 1 client, 2 endpoints",
        "Pick p99 with ÷ without scraping, 1 client, 2 endpoints",
        "Pick p50 with ÷ without scraping, parsed on the loop",
        "Pick p99 with ÷ without scraping, parsed on the loop",
    ]


def test_the_pages_change_on_every_answer_as_a_busy_replicas_do():
    from epick.bench.pages import page

    assert page(3, 1, "a,b") != page(3, 2, "a,b")
    assert b'running_lora_adapters="a,b"' in page(3, 1, "a,b")


def test_profile_parts_take_the_first_matching_frame_in_their_order(tmp_path):
    from epick.bench.profile import OTHER, summarize

    raw = tmp_path / "spy.txt"
    loop = "run (asyncio/base_events.py:1);Handle._run (asyncio/events.py:80)"
    raw.write_text("\n".join([
        f"{loop};PickerService.Pick (host/api/picker.py:1);Scheduler.schedule (s.py:1);"
        "TelemetryRecorder.stages (host/service.py:1) 3",
        f"{loop};PickerService.Pick (host/api/picker.py:1);Scheduler.schedule (s.py:1);"
        "WasmPolicy.score (p.py:1) 5",
        f"{loop};Pool._loop (pool.py:1);Pool._scrape (pool.py:2);parse_metrics (parse.py:1) 2",
        f"{loop} 10",
    ]) + "\n")
    total, shares = summarize(raw)
    assert total == 20
    assert dict(shares) == {OTHER: 0.5, "pick: policies score (WASM)": 0.25,
                            "pick: telemetry": 0.15, "scrape: parse (parse_metrics)": 0.1}


def test_pin_gives_the_servers_one_cpu_and_scraping_the_others_in_a_valid_config():
    import os

    from epick.config import loads

    serving, scraping = bench.pin_split()
    allowed = sorted(os.sched_getaffinity(0))
    assert serving == (allowed[0],) and scraping == tuple(allowed[1:])
    s = bench.Setup("x", 2, 50, serve_cpus=serving, worker_cpus=scraping)
    assert loads(s.config(1234)).pool.scrape_worker_cpus == list(scraping)


def test_with_a_policy_serves_it_after_the_defaults_and_gives_its_p50_ratio():
    from epick.config import loads

    s = bench.Setup("x", 2, 50, extra="latency")
    assert [p.name for p in loads(s.config(1234)).policies] == [
        "load", "prefix-cache", "lora-affinity", "latency"]
    assert [p.name for p in loads(bench.Setup("y", 2, 50).config(1)).policies] == [
        "load", "prefix-cache", "lora-affinity"]

    def setup(name, n, scrape_ms, pick_us, **kw):
        out = bench.Setup(name, n, scrape_ms, **kw)
        for key in ("seq_noop", "seq_pick", "par_noop", "par_pick", "stream_pick"):
            out.phases[key] = bench.Phase()
            out.phases[key].record([pick_us], 1.0)
        return out

    setups = [setup("8", 8, 50, 200.0), setup("8 off", 8, bench.NO_SCRAPE_MS, 200.0),
              setup("8 +latency", 8, 50, 230.0, extra="latency")]
    r = bench.ratios(setups, (8,))[-1]
    assert (r.what, r.value, r.goal, r.ok) == (
        "Pick p50 with ÷ without latency, 1 client, 8 endpoints", 230.0 / 200.0, "<= 1.10",
        False)


def test_base_mode_runs_the_tree_and_the_ref_side_by_side_and_gives_both_ratios(tmp_path):
    """`epick bench pick --grpc --base HEAD`: a server per side and size, both measured in
    every round, each importing its own checkout's epick."""
    import subprocess
    import sys

    from epick.bench.checkout import REPO

    done = subprocess.run(
        [sys.executable, "-m", "epick.cli", "bench", "pick", "--grpc", "--base", "HEAD",
         "--sizes", "2", "--seconds", "0.4", "--rounds", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "round 1/2: 2: base " in out and "round 2/2: 2: base " in out, out
    line = [x for x in out.splitlines() if x.startswith("2 endpoints: tree ÷ base Pick p50 ")]
    assert len(line) == 1 and "Pick ÷ no-op tree " in line[0], out
    assert "server CPU per Pick − per no-op " in line[0], out


def test_base_mode_shares_the_c_loop_only_when_its_source_is_the_same(tmp_path):
    from epick.bench.grpc_ab import NATIVE_LIB, NATIVE_SRC, share_native

    tree, base = tmp_path / "tree", tmp_path / "base"
    for root in (tree, base):
        (root / NATIVE_SRC).parent.mkdir(parents=True)
    assert "no C loop" in share_native(tree, base)
    (tree / NATIVE_SRC).write_text("int f(void) { return 1; }\n")
    (tree / NATIVE_LIB).write_bytes(b"\x7fELF built")
    (base / NATIVE_SRC).write_text("int f(void) { return 2; }\n")
    assert "scores in Python" in share_native(tree, base)
    assert not (base / NATIVE_LIB).exists()
    (base / NATIVE_SRC).write_text("int f(void) { return 1; }\n")
    assert "both sides" in share_native(tree, base)
    assert (base / NATIVE_LIB).read_bytes() == b"\x7fELF built"
