"""A log replayed against the policy set that recorded it reproduces every pick."""

from __future__ import annotations

from epick.decisions import Changes, read_file, replay, schema
from epick.decisions.reader import log_files


def test_replaying_a_log_against_its_own_policy_set_reproduces_every_pick(tmp_path, record,
                                                                          runtime):
    router, log = record(tmp_path / "d.log")
    assert log.written["decision"] == router.decisions > 150
    assert log.dropped == {"queue-full": 0, "write-error": 0}

    r = replay([tmp_path / "d.log"], runtime=runtime)

    assert r.decisions == router.decisions
    assert r.completions == router.decisions
    assert r.agreed == r.decisions and r.agreement == 1.0
    assert r.fallbacks_agreed == r.decisions
    assert r.unknown_completions == 0 and not r.replay_failed and not r.replay_policy_errors
    assert not r.cold_start and r.lost_records == 0
    assert {d.policy for d in r.score_deltas} == {"load", "prefix-cache", "lora-affinity"}
    for d in r.score_deltas:  # the log keeps f32 scores: equal up to that precision
        assert d.compared > 0 and d.changed == 0 and d.max_abs < 1e-6, d
    assert sum(a for a, _ in r.spread.values()) == r.decisions
    assert r.most_changed == []


def test_the_replay_depends_on_the_recorded_hooks(tmp_path, record, runtime):
    """Withholding the completions (post_response) changes picks: the policies' state
    really is rebuilt from the log, not copied from it."""
    record(tmp_path / "d.log", seconds=8.0)
    records = list(read_file(tmp_path / "d.log"))
    assert any(isinstance(x, schema.CompletionRec) for x in records)
    stripped = tmp_path / "no-completions.log"
    from epick.decisions.writer import _FRAME

    with open(stripped, "wb") as f:
        f.write(schema.MAGIC)
        for x in records:
            if not isinstance(x, schema.CompletionRec):
                blob = schema.encoder.encode(x)
                f.write(_FRAME.pack(len(blob)) + blob)

    full = replay([tmp_path / "d.log"], runtime=runtime)
    partial = replay([stripped], runtime=runtime)
    assert full.agreement == 1.0
    assert partial.decisions == full.decisions
    assert partial.agreement < 1.0


def test_a_changed_weight_and_profile_change_picks_and_say_which(tmp_path, record, runtime):
    # load without its recent picks: with them, a changed pick changes load's later
    # scores too (its state follows the picks, as lora-affinity's history does; below)
    record(tmp_path / "d.log", params={"load": {"recent_requests": 0.0}})
    changes = Changes(weights={"load": 5.0},
                      params={"lora-affinity": {"profile": "upstream"}})

    r = replay([tmp_path / "d.log"], changes, runtime=runtime, top=5)

    assert 0.0 < r.agreement < 1.0
    assert r.agreed < r.decisions
    assert len(r.most_changed) == 5
    for c in r.most_changed:
        assert c.recorded != c.replayed
        assert set(c.why) >= {"load", "lora-affinity", "total"}
    margins = [c.margin for c in r.most_changed]
    assert margins == sorted(margins, reverse=True)
    lora = next(d for d in r.score_deltas if d.policy == "lora-affinity")
    assert lora.changed > 0  # the upstream profile's tiers differ from the seed table
    load = next(d for d in r.score_deltas if d.policy == "load")
    assert load.changed == 0  # a weight changes totals, not the policy's own scores
    assert sum(b for _, b in r.spread.values()) == r.decisions
    assert "load w=5" in r.replayed_policies[0]


def test_loads_recent_picks_follow_the_replayed_picks(tmp_path, record, runtime):
    """With the defaults (recent picks on), picks that change under a changed weight
    change load's own later scores: its state is rebuilt from the replayed picks."""
    record(tmp_path / "d.log")
    r = replay([tmp_path / "d.log"], Changes(weights={"load": 5.0}), runtime=runtime)
    assert r.agreement < 1.0
    load = next(d for d in r.score_deltas if d.policy == "load")
    assert load.changed > 0


def test_a_replacement_module_scores_in_place_of_the_recorded_one(tmp_path, record, runtime):
    from epick.config import resolve_module

    record(tmp_path / "d.log")
    wasm = resolve_module("load").read_bytes()  # "prefix-cache" now runs the load policy

    r = replay([tmp_path / "d.log"], Changes(modules={"prefix-cache": (wasm, "load.wasm")}),
               runtime=runtime)

    prefix = next(d for d in r.score_deltas if d.policy == "prefix-cache")
    assert prefix.changed > 0
    assert r.prefix_hit_estimate[1] < r.prefix_hit_estimate[0]


def test_rotated_files_replay_as_one_log_and_each_file_stands_alone(tmp_path, record,
                                                                    runtime):
    router, _ = record(tmp_path / "d.log", max_file_bytes=150_000, embed_modules=False)
    files = log_files([tmp_path / "d.log"])
    assert len(files) >= 3
    assert files[-1] == tmp_path / "d.log"

    r = replay([tmp_path / "d.log"], runtime=runtime)
    assert r.decisions == router.decisions and r.agreement == 1.0 and r.restarts == 0

    for f in files:  # every file starts with a header and holds what it refers to
        first = next(read_file(f))
        assert isinstance(first, schema.Header)
    alone = replay([files[1]], runtime=runtime)
    assert alone.cold_start and alone.decisions > 0


def test_a_policy_that_failed_live_fails_there_again_in_the_replay(tmp_path, runtime):
    """A timeout under load skips a policy for one pick; the replay must skip it there
    too, or its pick — and every policy's state after it — would drift."""
    import msgspec
    from decision_logs import workload

    from epick.bench.quality import EpickRouter, wasm_set
    from epick.decisions import DecisionLog
    from epick.decisions.writer import _FRAME
    from epick.interfaces import PluginError
    from epick.runtime import WasmPolicy
    from epick.scheduler.policyset import PolicyEntry, PolicySet
    from epick.sim.config import DEFAULT_CONFIG
    from epick.sim.fleet import Fleet

    class Flaky(WasmPolicy):
        """The real module, timing out on every 9th score call (a loaded machine)."""

        calls = 0

        def score(self, cycle, candidates):
            Flaky.calls += 1
            if Flaky.calls % 9 == 0:
                raise PluginError(self.name, "score", "timeout", "score exceeded 1 ms")
            return super().score(cycle, candidates)

    live = wasm_set(runtime, {"load": 1.0, "prefix-cache": 1.0, "lora-affinity": 1.0})
    prefix = live.get("prefix-cache").plugin
    live = PolicySet(tuple(
        PolicyEntry(e.name, Flaky(prefix.module, name=e.name) if e.name == "prefix-cache"
                    else e.plugin, weight=e.weight) for e in live.entries))
    router = EpickRouter(live, seed=1)
    path = tmp_path / "d.log"
    log = DecisionLog(path).attach(router.scheduler).start()
    try:
        Fleet(8, msgspec.structs.replace(DEFAULT_CONFIG, max_loras=3), seed=1).run(
            workload(4.0), router, scrape_interval_s=0.05)
    finally:
        log.close()

    r = replay([path], runtime=runtime)
    assert r.live_failures > 10
    assert r.agreement == 1.0 and r.replay_policy_errors == {}

    # The same log without the failures noted: the replay's picks drift.
    stripped = tmp_path / "no-failures.log"
    with open(stripped, "wb") as f:
        f.write(schema.MAGIC)
        for x in read_file(path):
            if isinstance(x, schema.DecisionRec):
                x = msgspec.structs.replace(x, skipped=())
            blob = schema.encoder.encode(x)
            f.write(_FRAME.pack(len(blob)) + blob)
    assert replay([stripped], runtime=runtime).agreement < 1.0


def test_the_learning_latency_policy_replays_exactly(tmp_path, record, runtime):
    """latency learns from the completions' TTFT (post_response) and the requests' token
    counts: the log records both, so its replay reproduces every pick and score."""
    from epick.bench.quality import DEFAULT_WEIGHTS

    router, _ = record(tmp_path / "d.log", weights={**DEFAULT_WEIGHTS, "latency": 1.0})
    records = list(read_file(tmp_path / "d.log"))
    assert any(isinstance(x, schema.CompletionRec) and x.ttft_s for x in records)
    assert all(x.request.prompt_tokens > 0 for x in records if isinstance(x, schema.DecisionRec))

    r = replay([tmp_path / "d.log"], runtime=runtime)

    assert r.decisions == router.decisions and r.agreement == 1.0
    latency = next(d for d in r.score_deltas if d.policy == "latency")
    assert latency.compared > 0 and latency.changed == 0
