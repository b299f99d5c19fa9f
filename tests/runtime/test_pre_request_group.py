"""A pick's pre_request hooks in one call (epick.runtime.plugin.pre_request_all, the
policy set's ``pre_request_group``) against each policy's own ``pre_request``: the same
picks, scores, failures, breaker states, stats, checkpoints and policy state — for the
built-in policies learning from completions, and for policies whose carried events fail,
whose version 1 hook traps, and whose breakers open and close again."""

from __future__ import annotations

import msgspec
import pytest
from fakes import FakeClock
from wat_modules import wasm

from epick.bench import pick
from epick.config import resolve_module
from epick.runtime import Limits, Runtime, WasmPolicy, checkpoints
from epick.runtime.plugin import pre_request_all
from epick.scheduler.policyset import PolicyEntry, PolicySet
from epick.scheduler.scheduler import Scheduler


@pytest.fixture(autouse=True)
def steady_checkpoints(monkeypatch):
    """Captures every ``checkpoint_interval_s`` of the fake clock, however long an export
    takes on a busy machine (else the gap stretches with the export's own time, and two
    runs capture at different picks)."""
    monkeypatch.setattr(checkpoints, "CHECKPOINT_SHARE", 1e12)


def _one_by_one(policies: PolicySet, grouped: bool) -> PolicySet:
    assert policies.pre_request_group is pre_request_all
    if not grouped:  # what the scheduler does for a set without a shared group
        object.__setattr__(policies, "pre_request_group", None)
    return policies


def _row(d) -> tuple:
    return (d.endpoint, tuple(d.fallbacks), tuple(d.skipped),
            tuple((c.endpoint, c.total, tuple(sorted(c.scores.items())))
                  for c in d.explanation or ()))


def _plugin_row(e: PolicyEntry) -> tuple:
    p = e.plugin
    s = p.stats
    return (e.name, sorted(p.breaker_states.items()), s.calls, s.errors,
            sorted(s.errors_by_kind.items()), s.recoveries, s.checkpoints,
            s.checkpoint_failures, p.checkpoints.good_state)


def _builtin_run(grouped: bool, n: int) -> list:
    view = pick.synthetic_view(n)
    clock = FakeClock()
    rows = []
    with Runtime() as rt:
        entries = []
        for name in ("load", "prefix-cache", "lora-affinity", "latency"):
            module = rt.compile(resolve_module(name).read_bytes(), name=name)
            entries.append(PolicyEntry(name, WasmPolicy(module, {}, name=name, clock=clock)))
        policies = _one_by_one(PolicySet(tuple(entries)), grouped)
        wall = FakeClock(1.7e9)
        s = Scheduler(lambda: view, policies, clock=clock, wall_clock=wall)
        for k, r in enumerate(pick.request_stream(200, seed=11, latency=True)):
            wall.advance(0.01)
            clock.advance(0.05)  # a checkpoint falls due every 20 picks
            d = s.schedule(r, explain=k % 2 == 0)
            rows.append(_row(d))
            s.complete(decision_id=d.decision_id, ttft_s=0.02 + len(r.prompt) * 1e-5,
                       prompt_tokens=len(r.prompt) // 4, completion_tokens=16)
            if k % 50 == 49:
                rows.append(tuple(_plugin_row(e) for e in entries))
        rows.append(tuple(e.plugin.export_state() for e in entries))
    return rows


@pytest.mark.parametrize("n", [8, 64])
def test_the_builtin_policies_record_picks_alike_grouped_and_one_by_one(n):
    grouped = _builtin_run(True, n)
    assert grouped == _builtin_run(False, n)
    checkpoints = grouped[-2]
    assert all(row[6] >= 5 for row in checkpoints[1:])  # captured on hooks, as before


def _failing_run(grouped: bool) -> list:
    """moody2 (ABI v2: an event over 2000 bytes fails when carried), counter (version 1:
    its own pre_request call, which traps on an input over 4000 bytes) and counter2 (v2),
    on a fake clock: long request ids and long prompts fail the hooks, breakers open,
    cool down and close, instances are re-created, checkpoints are taken."""
    clock = FakeClock()
    rows = []
    limits = Limits(breaker_failures=2, breaker_cooldown_s=1.0, breaker_burn_ms=60_000.0)
    with Runtime(limits) as rt:
        def policy(name: str, wat: str, **subst) -> WasmPolicy:
            return WasmPolicy(rt.compile(wasm(wat, **subst), name=name), {}, name=name,
                              clock=clock, now_ms=lambda: 42)

        entries = (PolicyEntry("moody", policy("moody", "moody2", shift=100)),
                   PolicyEntry("counter", policy("counter", "counter")),
                   PolicyEntry("counter2", policy("counter2", "counter2")))
        policies = _one_by_one(PolicySet(entries), grouped)
        view = pick.synthetic_view(9)
        s = Scheduler(lambda: view, policies, clock=clock, wall_clock=lambda: 1e9)
        for k, r in enumerate(pick.request_stream(40, seed=5)):
            if k % 7 in (1, 2, 3):  # carried events that fail (reported by the next call)
                r = msgspec.structs.replace(r, request_id=f"{k}" + "x" * 2100)
            if k % 13 in (4, 5, 6):  # counter's version 1 hook traps, three in a row:
                # re-created twice, then its breaker opens (circuit-open), cools down
                r = msgspec.structs.replace(r, prompt="y" * 5000)
            d = s.schedule(r, explain=True)
            rows.append(_row(d))
            rows.append(tuple(_plugin_row(e) for e in entries))
            s.complete(decision_id=d.decision_id)
            clock.advance(0.4)
        rows.append(tuple(e.plugin.export_state() for e in entries))
    return rows


def test_failing_hooks_are_handled_alike_grouped_and_one_by_one():
    grouped = _failing_run(True)
    assert grouped == _failing_run(False)
    skipped = " | ".join(" ".join(row[2]) for row in grouped[0:-1:2])
    # the transcript has what the one-by-one path handles: carried events that failed,
    # a trap in a version 1 hook, its breaker open, half-open and closed again
    moody, counter = grouped[-2][0], grouped[-2][1]
    assert dict(moody[4])["error"] >= 10 and moody[5] == 0
    assert "counter: trap" in skipped and "counter: circuit-open" in skipped
    states = [dict(row[1][1])["pre_request"] for row in grouped[1:-1:2]]
    assert "open" in states and states[-1] == "closed"
    assert moody[6] >= 5 and counter[6] >= 5  # checkpoints taken on hooks


def test_only_sets_of_plain_wasm_hooks_are_grouped():
    with Runtime() as rt:
        wasm_set = pick.wasm_policies(rt, ("load", "prefix-cache"))
        assert wasm_set.pre_request_group is pre_request_all
        py = pick.python_policies().get("load")
        assert wasm_set.put(PolicyEntry("py-load", py.plugin)).pre_request_group is None

        class Wrapped(WasmPolicy):  # overrides pre_request: the group would bypass it
            def pre_request(self, cycle, endpoint):
                super().pre_request(cycle, endpoint)

        wrapped = Wrapped(wasm_set.get("load").plugin.module, name="wrapped")
        assert wrapped.pre_request_group is None
        assert wasm_set.put(PolicyEntry("wrapped", wrapped)).pre_request_group is None
