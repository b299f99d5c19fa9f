"""`python -m epick.bench.stages`: every probe finds its target, the rows add up, the
guest split is arithmetic on given figures. No timing is asserted."""

from __future__ import annotations

import pytest

from epick.bench import stages


def test_every_probe_finds_its_target():
    """A rename on the pick path must move its probe too (epick.bench.stages.PROBES)."""
    gone = [p.target for p in stages.PROBES if stages._resolve(p.target)[0] is None]
    assert not gone, f"update epick.bench.stages.PROBES: {gone}"


def test_a_probe_counts_its_calls_and_restores_the_original():
    class Thing:
        def work(self, x):
            return x * 2

    probe = stages.Probe(f"{__name__}:Thing.work", "thing")
    globals()["Thing"] = Thing
    try:
        original = Thing.__dict__["work"]
        profile = stages.Profile((probe,))
        with profile.installed():
            assert Thing().work(21) == 42
            assert Thing().work(1) == 2
        assert Thing.__dict__["work"] is original
        assert profile.calls["thing"] == 2 and profile.ns["thing"] > 0
        assert profile.parent["thing"] == {stages.ROOT: 2}
    finally:
        del globals()["Thing"]


def test_a_gone_target_is_listed_not_raised():
    profile = stages.Profile((stages.Probe("epick.no_such_module:f", "x"),
                              stages.Probe("epick.bench.stages:NoSuchClass.f", "y")))
    with profile.installed():
        pass
    assert profile.missing == ["epick.no_such_module:f", "epick.bench.stages:NoSuchClass.f"]


def test_the_guest_call_splits_into_crossing_decode_and_work():
    rows = {"policy load: score crossing + guest": 10.0, "picker": 3.0}
    calls = {"policy load: score crossing + guest": 1.0, "picker": 1.0}
    stages._split_guest(rows, calls, 1.5, {("load", "score"): 5.5})
    assert rows == {"picker": 3.0, "policy load: score crossing": 1.5,
                    "policy load: score guest: SDK decode": 4.0,
                    "policy load: score guest: policy work": pytest.approx(4.5)}
    # The decode estimate never exceeds what the guest took.
    rows = {"policy p: score crossing + guest": 3.0}
    stages._split_guest(rows, {"policy p: score crossing + guest": 1.0}, 1.0,
                        {("p", "score"): 9.0})
    assert rows["policy p: score guest: SDK decode"] == 2.0
    assert rows["policy p: score guest: policy work"] == 0.0


def test_a_short_real_run_has_a_row_per_stage_and_policy_adding_up_to_the_total():
    res = stages.measure(endpoints=4, picks=50, rounds=1, noop=True)
    labels = [label for label, _, _ in res.rows]
    assert not res.missing
    for policy in ("load", "prefix-cache", "lora-affinity"):
        for part in ("crossing", "guest: SDK decode", "guest: policy work"):
            assert f"policy {policy}: score {part}" in labels
    for stage in ("validation (pin_of, to_request)", "picker", "decision memory",
                  "telemetry"):
        assert stage in labels
    # ABI v2 policies get the score frame; a version 1 module would get msgpack
    assert "score frame encode (ABI v2, once a cycle)" in labels
    assert sum(us for _, us, _ in res.rows) == pytest.approx(res.whole[stages.ROOT])
    text = stages.render(res)
    assert "total (plain answer_pick)" in text and "policy load: score crossing" in text
