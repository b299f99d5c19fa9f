"""The native loop (epick.runtime.scoreall: every scorer of a pick in one C call) against
the Python path: the same seeds give the same picks, scores, totals, failures, stats,
breaker states and policy state — for the built-in policies, and for a policy that traps,
runs out of fuel or time, errs, writes bad scores or grows its memory between calls.
Without the library the Python path runs alone."""

from __future__ import annotations

import subprocess
from pathlib import Path

import msgspec
import numpy as np
import pytest
from fakes import FakeClock
from wat_modules import wasm

from epick.bench import pick
from epick.runtime import Limits, Runtime, WasmPolicy, scoreall
from epick.scheduler.policyset import PolicyEntry, PolicySet
from epick.scheduler.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def library():
    """The library, built when missing (``make native`` builds it; so does this)."""
    if not scoreall.LIBRARY.exists():
        subprocess.run(["make", "-s", "score-lib"], cwd=ROOT, check=True)
    assert scoreall.use_library(), "libepick_scoreall.so did not load"
    yield
    scoreall.use_library()


@pytest.fixture
def native_calls(monkeypatch):
    """How many picks the native loop ran (calls into the library)."""
    count = [0]
    real = scoreall._call

    def counting(*args):
        count[0] += 1
        return real(*args)

    monkeypatch.setattr(scoreall, "_call", counting)
    return count


def _decision_row(d) -> tuple:
    return (d.endpoint, tuple(d.fallbacks), tuple(d.skipped),
            tuple((c.endpoint, c.total, tuple(sorted(c.scores.items())))
                  for c in d.explanation or ()))


def _builtin_run(native: bool, n: int, names: tuple[str, ...], picks: int) -> tuple:
    scoreall.enabled = native
    view = pick.synthetic_view(n)
    rows = []
    with Runtime() as rt:
        policies = pick.wasm_policies(rt, names)
        wall = FakeClock(1.7e9)  # the latency policy reads the time: the same in both runs
        s = Scheduler(lambda: view, policies, wall_clock=wall)
        for k, r in enumerate(pick.request_stream(picks, seed=7, latency=True)):
            wall.advance(0.01)
            # every other pick without explain: nobody keeps the scores, only the totals
            d = s.schedule(r, explain=k % 2 == 0)
            rows.append(_decision_row(d))
            s.complete(decision_id=d.decision_id, ttft_s=0.02 + len(r.prompt) * 1e-5,
                       prompt_tokens=len(r.prompt) // 4, completion_tokens=16)
        states = [e.plugin.export_state() for e in policies.entries]
        calls = [e.plugin.stats.calls for e in policies.entries]
    return rows, states, calls


@pytest.mark.parametrize("n", [8, 64])
def test_the_builtin_policies_pick_the_same_on_both_paths(n, native_calls):
    names = ("load", "prefix-cache", "lora-affinity", "latency")
    native = _builtin_run(True, n, names, 300)
    assert native_calls[0] >= 299  # every pick but the first (its snapshot delivery)
    python = _builtin_run(False, n, names, 300)
    assert native[0] == python[0]  # endpoints, fallbacks, totals, every policy's scores
    assert native[1] == python[1]  # the policies' state after learning from completions
    assert native[2] == python[2]


def _moody_run(native: bool, limits: Limits, sizes: list[int]) -> tuple:
    """Picks over views of ``sizes`` endpoints with moody2 between two well-behaved
    scorers (weights 1, 0.5, 2): a transcript of everything a policy's failure touches."""
    scoreall.enabled = native
    clock = FakeClock()
    rows = []
    with Runtime(limits) as rt:
        def policy(name: str, shift: int) -> WasmPolicy:
            return WasmPolicy(rt.compile(wasm("moody2", shift=shift), name=name), {},
                              name=name, clock=clock, now_ms=lambda: 42,
                              checkpoint_on_hooks=False)

        entries = (PolicyEntry("before", policy("before", 100)),  # always well-behaved
                   PolicyEntry("moody", policy("moody", 0), weight=0.5),
                   PolicyEntry("after", policy("after", 1), weight=2.0))
        policies = PolicySet(entries)
        assert policies.score_group is scoreall.score_all
        views = {n: pick.synthetic_view(n) for n in set(sizes)}
        current = [views[sizes[0]]]
        s = Scheduler(lambda: current[0], policies, clock=clock, wall_clock=lambda: 1e9)
        for n, r in zip(sizes, pick.request_stream(len(sizes), seed=3)):
            current[0] = views[n]
            d = s.schedule(r, explain=True)
            rows.append(_decision_row(d))
            rows.append(tuple((e.name, e.plugin.breaker_state, e.plugin.stats.calls,
                               e.plugin.stats.errors, sorted(e.plugin.stats.errors_by_kind.items()),
                               e.plugin.stats.out_of_range, e.plugin.stats.recoveries,
                               e.plugin.stats.timeout_retries) for e in entries))
            s.complete(decision_id=d.decision_id)
            clock.advance(3.0)
        rows.append(tuple(e.plugin.export_state() for e in entries))
    return rows


# Every misbehaviour of moody2 (by candidate count), each after clean picks that carry
# events, with "after" misbehaving alike at one candidate more.
_SIZES = [12, 12, 1, 12, 2, 12, 3, 12, 4, 12, 5, 12, 6, 12, 7, 12, 8, 12, 9, 12, 8, 9, 13, 12]


def test_failures_are_handled_alike_on_both_paths(native_calls):
    limits = Limits(fuel=200_000, budget_ms=500.0, breaker_burn_ms=60_000.0)
    native = _moody_run(True, limits, _SIZES)
    assert native_calls[0] >= len(_SIZES) - 2
    python = _moody_run(False, limits, _SIZES)
    assert native == python
    # and the transcript shows each failure, named as the Python path names it
    skipped = " | ".join(" ".join(row[2]) for row in native[0:-1:2])
    for kind in ("trap", "out-of-fuel", "error", "invalid-output"):
        assert f"moody: {kind}" in skipped and f"after: {kind}" in skipped
    assert "three is a crowd" in skipped
    moody_stats = native[-2][1]
    assert moody_stats[5] > 0  # 1.5 clamped: counted out of range
    for state in native[-1][1:]:
        grown = np.frombuffer(state, dtype="<i4")
        assert grown[1] == 2  # memory grew twice between calls, the scores read right after


def test_a_timeout_is_retried_and_reported_alike_on_both_paths(native_calls):
    # fuel enough to spin past the epoch deadline: the wall-clock backstop stops it
    limits = Limits(fuel=10_000_000_000, budget_ms=5.0, breaker_burn_ms=60_000.0)
    sizes = [12, 2, 12, 12]
    native = _moody_run(True, limits, sizes)
    python = _moody_run(False, limits, sizes)
    assert native == python
    assert "moody: timeout" in " ".join(native[2][2])
    assert native[3][1][7] == 1  # the timeout was retried once, on a new instance


def test_a_carried_event_that_fails_is_reported_as_pre_request_on_both_paths(native_calls):
    def run(native: bool) -> tuple:
        scoreall.enabled = native
        with Runtime(Limits(breaker_burn_ms=60_000.0)) as rt:
            plugin = WasmPolicy(rt.compile(wasm("moody2", shift=100), name="m"), {}, name="m",
                                clock=FakeClock(), checkpoint_on_hooks=False)
            other = WasmPolicy(rt.compile(wasm("counter2"), name="c"), {}, name="c",
                               clock=FakeClock(), checkpoint_on_hooks=False)
            policies = PolicySet((PolicyEntry("m", plugin), PolicyEntry("c", other)))
            view = pick.synthetic_view(9)
            s = Scheduler(lambda: view, policies)
            out = []
            for r in pick.request_stream(4, seed=5):
                # a request id over 2000 bytes: its pre_request event fails when carried
                if r.request_id == "r1":
                    r = msgspec.structs.replace(r, request_id="x" * 2100)
                d = s.schedule(r, explain=True)
                out.append(_decision_row(d))
                out.append((plugin.stats.errors_by_kind.copy(),
                            plugin.breaker_states.get("pre_request"), plugin.stats.calls))
            out.append(plugin.export_state())
        return out

    native, python = run(True), run(False)
    assert native == python
    # r1's event rides on r2's score and fails there: the pre_request stage's failure, once
    assert native[3][0] == {} and native[5][0] == {"error": 1} == native[7][0]
    assert native_calls[0] >= 3


def test_without_the_library_the_python_path_runs_with_the_same_picks(tmp_path, native_calls):
    with_lib = _builtin_run(True, 8, ("load", "prefix-cache", "lora-affinity"), 100)
    assert native_calls[0] > 0
    calls = native_calls[0]
    assert not scoreall.use_library(tmp_path / "libepick_scoreall.so")  # not there
    assert not scoreall.available
    # enabled stays off whatever a caller sets: score_all finds no library
    without = _builtin_run(False, 8, ("load", "prefix-cache", "lora-affinity"), 100)
    assert native_calls[0] == calls
    assert with_lib == without
    assert scoreall.use_library()


def test_the_environment_turns_the_native_loop_off(monkeypatch):
    monkeypatch.setenv("EPICK_SCORE_NATIVE", "0")
    assert not scoreall.use_library() and scoreall.available
    monkeypatch.delenv("EPICK_SCORE_NATIVE")
    assert scoreall.use_library()


def test_only_sets_of_plain_wasm_scorers_take_the_native_loop():
    with Runtime() as rt:
        wasm_set = pick.wasm_policies(rt, ("load", "prefix-cache"))
        assert wasm_set.score_group is scoreall.score_all
        # a Python scorer beside them: every scorer is called one by one
        mixed = wasm_set.put(pick.python_policies().get("load").__class__(
            "py-load", pick.python_policies().get("load").plugin))
        assert mixed.score_group is None

        class Wrapped(WasmPolicy):  # overrides score: the loop would bypass it
            def score(self, cycle, candidates):
                return super().score(cycle, candidates)

        load = wasm_set.get("load").plugin
        wrapped = Wrapped(load.module, name="wrapped")
        assert wrapped.score_group is None
        assert wasm_set.put(PolicyEntry("wrapped", wrapped)).score_group is None
