"""Properties every policy must meet, whatever its kind (policies/ABI.md's contract).

Each property is a function ``(Probe) -> CaseResult`` named ``property/<what>``:

    one-result-per-candidate   exactly one finite score in [0, 1] (or one keep byte) each
    deterministic              same calls, same outputs: twice in a row, on two instances
    candidate-counts           0, 1 and 1,024 candidates
    ignores-future-fields      extra trailing elements in every payload array change nothing
    resident-matches-inline    set_snapshot + nil gives what an inline snapshot gives
    bad-input-is-an-error      garbage / truncated / out-of-range input: PolicyCallError,
                               never a trap, and the instance keeps working
    bad-params-are-refused     an unknown or ill-typed param: init refuses, naming the key
    time-budget                the heaviest inputs (1,024 endpoints, the longest prompt) never
                               run out of fuel (the per-call instruction budget: the same
                               verdict on any machine), nor hit the wall-clock backstop
                               three times in a row (one hit can be a busy machine)
    memory-stable              linear memory does not grow from call 5,000 to call 10,000
    reinit-resets-state        init after a history gives a fresh instance's outputs

They run with the params the policy will go live with, on a fixed, generated "probe"
pool (:func:`probe_snapshot`), so every run makes the same calls.
"""

from __future__ import annotations

import dataclasses
import random
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec
import numpy as np

from epick import abi
from epick.conformance.driver import Driver, encode, encode_with_future_fields
from epick.conformance.report import CaseResult
from epick.conformance.runner import fmt, render
from epick.runtime.errors import (
    PolicyCallError,
    PolicyError,
    PolicyLoadError,
    PolicyOutOfFuel,
    PolicyTimeout,
)

__all__ = ["PROPERTIES", "Probe", "probe_snapshot", "run_properties"]

_ADAPTERS = ("a0", "a1", "a2", "a3", "a4", "a5")
#: ~20 KiB of prompt: more than 256 blocks of 64 bytes (the default block cap), with
#: multi-byte UTF-8 in it.
_LONG_PROMPT = "".join(f"line {i}: ünïcode, tokens & more tokens. " for i in range(500))
_PROMPT = _LONG_PROMPT[:700]

PROBE_REQUESTS = (
    abi.Request(request_id="p1", model="m", adapter="a1", prompt=_PROMPT, seed=7),
    abi.Request(
        request_id="p2", model="m", prompt=_PROMPT[:300], criticality=abi.Criticality.CRITICAL,
        seed=8,
    ),
    abi.Request(
        request_id="p3", model="m", adapter="a4", prompt="short", seed=2**64 - 1,
        criticality=abi.Criticality.SHEDDABLE, cache_salt="tenant", headers={"x-k": "v"},
    ),
)


def _addr(i: int) -> str:
    """The address of the probe pool's endpoint ``i`` (stable across versions)."""
    return f"10.0.{i // 250}.{i % 250}:8000"


def probe_snapshot(n: int, *, version: int = 1, timestamp_ms: int = 1_000) -> abi.Snapshot:
    """A pool of ``n`` endpoints with varied load and adapters (same ``n``, same pool)."""
    eps = []
    for i in range(n):
        shift = version + i
        eps.append(
            abi.EndpointMetrics(
                address=_addr(i),
                waiting=(shift * 7) % 13,
                running=(shift * 3) % 11,
                kv_usage=((shift * 37) % 101) / 100,
                running_adapters=_ADAPTERS[i % 4 : i % 4 + i % 3],
                waiting_adapters=_ADAPTERS[(i + 2) % 6 : (i + 2) % 6 + (i // 3) % 2],
                max_lora=i % 5,
                num_gpu_blocks=1000 + i,
                block_size=16,
            )
        )
    return abi.Snapshot(version=version, timestamp_ms=timestamp_ms, endpoints=tuple(eps))


@dataclass
class Probe:
    """The module under test, the params it goes live with, and fresh instances of it."""

    module: object
    params: dict
    export: str | None = None
    """``score`` or ``filter``: which one the call-based properties exercise."""

    def driver(self, **kw) -> Driver:
        return Driver(self.module.instantiate(self.params), use=self.export, **kw)

    def script(self, d: Driver) -> list[np.ndarray]:
        """The standard call sequence: 3 snapshots, scores/filters, hooks. Its outputs."""
        out: list[np.ndarray] = []
        for v, ts in ((1, 1_000), (2, 2_500), (3, 4_000)):
            snap = probe_snapshot(16, version=v, timestamp_ms=ts)
            for req in PROBE_REQUESTS:
                out.append(d.call(snap, req, range(16)))
                out.append(d.call(snap, req, (4, 3, 2, 1, 0)))
            for k, req in enumerate(PROBE_REQUESTS):
                ev = abi.PreRequestEvent(request=req, endpoint=_addr(k * v), timestamp_ms=ts + 1)
                d.pre_request(ev)
            d.post_response(
                abi.PostResponseEvent(
                    request_id="p2", endpoint=_addr(2 * v), timestamp_ms=ts + 2, model="m"
                )
            )
        return out


def _result(name: str, ok: bool, expected: str, got: str, why: str, t0: float) -> CaseResult:
    return CaseResult(
        name=f"property/{name}",
        expected=expected,
        got=got,
        verdict="pass" if ok else "fail",
        why=why if ok else f"property/{name}: {why}",
        group="property",
        seconds=time.perf_counter() - t0,
    )


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> int | None:
    """Index of the first differing output (exact equality, NaN equal to NaN), or None."""
    if len(a) != len(b):
        return min(len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape or not np.array_equal(x, y, equal_nan=True):
            return i
    return None


def _bad_values(out: np.ndarray, n: int) -> str | None:
    if len(out) != n:
        return f"{len(out)} results for {n} candidates"
    if out.dtype == np.bool_:
        return None
    bad = ~np.isfinite(out) | (out < 0) | (out > 1)
    if bad.any():
        i = int(np.argmax(bad))
        return f"candidate {i} scored {fmt(out[i])} (not a finite number in [0, 1])"
    return None


# ------------------------------------------------------------------------ properties


def one_result_per_candidate(p: Probe) -> CaseResult:
    t0 = time.perf_counter()
    d = p.driver()
    checked = 0
    for n in (1, 2, 5, 64):
        snap = probe_snapshot(n)
        for req in PROBE_REQUESTS:
            out = d.call(snap, req, range(n))
            checked += 1
            bad = _bad_values(out, n)
            if bad:
                return _result(
                    "one-result-per-candidate", False, "n results in [0, 1]", bad,
                    f"{n} candidates, request {req.request_id}: {bad}", t0,
                )
    outs = p.script(d)
    for i, out in enumerate(outs):
        bad = _bad_values(out, len(out))
        if bad:
            return _result(
                "one-result-per-candidate", False, "results in [0, 1]", bad,
                f"probe script call {i}: {bad}", t0,
            )
    return _result(
        "one-result-per-candidate", True, "n results in [0, 1]", f"{checked + len(outs)} calls ok",
        "one finite result in [0, 1] per candidate", t0,
    )


def deterministic(p: Probe) -> CaseResult:
    t0 = time.perf_counter()
    a, b = p.driver(), p.driver()
    snap = probe_snapshot(16)
    twice = [a.call(snap, PROBE_REQUESTS[0], range(16)) for _ in range(2)]
    if not np.array_equal(twice[0], twice[1]):
        return _result(
            "deterministic", False, "same output", "changed",
            f"the same call twice in a row gave {render(twice[0])} then {render(twice[1])}", t0,
        )
    first = _same(p.script(a), p.script(b))
    if first is not None:
        return _result(
            "deterministic", False, "same outputs", f"call {first} differs",
            f"two instances given the same calls differ at probe call {first}", t0,
        )
    return _result(
        "deterministic", True, "same outputs", "same", "same calls, same outputs", t0
    )


def candidate_counts(p: Probe) -> CaseResult:
    t0 = time.perf_counter()
    d = p.driver()
    got = []
    for n_endpoints, candidates in ((8, ()), (8, (5,)), (1024, tuple(range(1024)))):
        snap = probe_snapshot(n_endpoints)
        try:
            out = d.call(snap, PROBE_REQUESTS[0], candidates)
        except PolicyError as exc:
            return _result(
                "candidate-counts", False, "0, 1, 1024 results", f"{len(candidates)}: error",
                f"{len(candidates)} candidates: {type(exc).__name__}: {exc}", t0,
            )
        bad = _bad_values(out, len(candidates))
        if bad:
            return _result(
                "candidate-counts", False, "0, 1, 1024 results", bad,
                f"{len(candidates)} candidates: {bad}", t0,
            )
        got.append(str(len(out)))
    return _result(
        "candidate-counts", True, "0, 1, 1024 results", ", ".join(got),
        "works with 0, 1 and 1,024 candidates", t0,
    )


def ignores_future_fields(p: Probe) -> CaseResult:
    t0 = time.perf_counter()
    plain = p.script(p.driver())
    future = p.script(p.driver(encode=encode_with_future_fields))
    first = _same(plain, future)
    if first is not None:
        return _result(
            "ignores-future-fields", False, "same outputs", f"call {first} differs",
            f"with unknown trailing fields in every payload, probe call {first} gave "
            f"{render(future[first])} instead of {render(plain[first])}", t0,
        )
    return _result(
        "ignores-future-fields", True, "same outputs", "same",
        "unknown trailing snapshot/endpoint/request/event fields are ignored", t0,
    )


def resident_matches_inline(p: Probe) -> CaseResult:
    t0 = time.perf_counter()
    resident = p.driver()
    if not resident.resident:
        return _result(
            "resident-matches-inline", True, "n/a", "n/a",
            "the policy does not export set_snapshot: snapshots always come inline", t0,
        )
    a = p.script(resident)
    b = p.script(p.driver(inline=True))
    first = _same(a, b)
    if first is not None:
        return _result(
            "resident-matches-inline", False, "same outputs", f"call {first} differs",
            f"probe call {first}: set_snapshot + nil gave {render(a[first])}, the inline "
            f"snapshot {render(b[first])}", t0,
        )
    return _result(
        "resident-matches-inline", True, "same outputs", "same",
        "a resident snapshot scores like an inline one", t0,
    )


def _bad_inputs(valid: bytes) -> Iterable[tuple[str, bytes]]:
    yield "empty input", b""
    yield "the never-used msgpack byte 0xc1", b"\xc1"
    yield "a msgpack map instead of an array", encode({"snapshot": None})
    yield "a bare integer", encode(5)
    rng = random.Random(6)
    for i in range(4):
        yield f"random bytes #{i}", bytes(rng.randrange(256) for _ in range(8 + 40 * i))
    for cut in sorted({1, 2, len(valid) // 4, len(valid) // 2, len(valid) - 1}):
        yield f"the valid input cut to {cut} of {len(valid)} bytes", valid[:cut]
    yield "the valid input with a garbage byte appended", valid + b"\xc1"
    flipped = bytearray(valid)
    flipped[0] = 0x91  # array header claiming 1 element
    yield "the valid input with its array header changed", bytes(flipped)


def _bad_frames(valid: bytes) -> Iterable[tuple[str, bytes]]:
    """Broken ABI v2 score frames derived from ``valid`` (8 candidates, inline snapshot)."""
    def patched(word: int, value: int) -> bytes:
        out = bytearray(valid)
        struct.pack_into("<I", out, 4 * word, value)
        return bytes(out)

    yield "an empty frame", b""
    yield "a header cut short", valid[:20]
    for cut in sorted({40, len(valid) // 2, len(valid) - 1}):
        yield f"the valid frame cut to {cut} of {len(valid)} bytes", valid[:cut]
    yield "the valid frame with a garbage byte appended", valid + b"\xc1"
    yield "a candidate count past the end", patched(0, 1 << 30)
    yield "present bits beyond its arrays", patched(2, 1 << 20)
    yield "more arrays than 32", patched(1, 33)
    yield "a request longer than the frame", patched(3, 1 << 20)
    yield "a snapshot length one byte too long", patched(4, struct.unpack_from("<I", valid, 16)[0] + 1)
    out = bytearray(valid)
    struct.pack_into("<I", out, 32, 8)  # candidate 0 = 8, of 8 endpoints
    yield "a candidate index out of range", bytes(out)
    out = bytearray(valid)
    start = len(valid) - struct.unpack_from("<I", valid, 16)[0] - struct.unpack_from("<I", valid, 12)[0]
    out[start] = 0xc1  # the request's first byte
    yield "a request that is not msgpack", bytes(out)
    rng = random.Random(7)
    for i in range(3):
        yield f"random bytes #{i}", bytes(rng.randrange(256) for _ in range(32 + 40 * i))


def _retry_timeouts(fn: Callable[[], object], retries: int) -> object:
    """``fn()``, retried when it hits the deadline, as :meth:`Driver._call` does: on a busy
    machine a clean refusal can be descheduled past a 1 ms budget."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except PolicyTimeout:
            if attempt == retries:
                raise
    raise AssertionError("unreachable")


def bad_input_is_an_error(p: Probe) -> CaseResult:
    t0 = time.perf_counter()
    d = p.driver()
    snap = probe_snapshot(8)
    req = PROBE_REQUESTS[0]
    before = d.call(snap, req, range(8))
    inst = d.instance
    score_input = encode(abi.ScoreInput(snapshot=snap, request=req, candidates=tuple(range(8))))
    call = d.use
    run = getattr(inst, call)
    cases: list[tuple[str, Callable[[], object]]] = []
    for label, blob in _bad_inputs(score_input):
        cases.append((f"{call}: {label}", lambda blob=blob: run(blob, 8)))
    for label, cands in (
        ("candidate index 8 of 8 endpoints", (0, 8)),
        ("candidate index -1", (0, -1)),
    ):
        blob = encode([snap, req, list(cands)])
        cases.append((f"{call}: {label}", lambda blob=blob, n=len(cands): run(blob, n)))
    blob = encode([snap, req, ["x"]])
    cases.append((f"{call}: a string candidate", lambda blob=blob: run(blob, 1)))
    if getattr(inst, "abi_version", 1) >= 2:
        # Version 2 reads a score frame: the same garbage, and broken frames, reach the
        # guest itself (the msgpack above is refused by the host before it is framed).
        framed = getattr(inst, f"{call}_frame")
        for label, blob in _bad_frames(abi.frame_from_score_input(score_input)):
            cases.append((f"{call} frame: {label}",
                          lambda blob=blob: framed(blob, 8)))
    blob = encode([snap, "not a request", [0]])
    cases.append((f"{call}: a string request", lambda blob=blob: run(blob, 1)))
    hooks = [
        ("pre_request", encode(abi.PreRequestEvent(request=req, endpoint=_addr(0), timestamp_ms=5))),
        ("post_response", encode(abi.PostResponseEvent(request_id="p1", endpoint=_addr(0)))),
    ]
    if d.resident:
        hooks.append(("set_snapshot", encode(snap)))
    for export, valid in hooks:
        if not inst.has(export):
            continue
        fn = getattr(inst, export)
        for label, blob in _bad_inputs(valid):
            cases.append((f"{export}: {label}", lambda fn=fn, blob=blob: fn(blob)))

    wrong: list[str] = []
    for label, fn in cases:
        try:
            _retry_timeouts(fn, d.timeout_retries)
        except PolicyCallError:
            continue
        except PolicyError as exc:
            wrong.append(f"{label} -> {type(exc).__name__}: {exc.detail}")
            d = p.driver()  # a trapped instance is not to be trusted; go on with a fresh one
            inst = d.instance
            run = getattr(inst, call)
            d.call(snap, req, range(8))
            continue
        wrong.append(f"{label} -> accepted (no error)")
    if not wrong:
        d.forget_snapshot()
        after = d.call(snap, req, range(8))
        if not np.array_equal(before, after):
            wrong.append(
                f"after the bad inputs the same call gives {render(after)}, before {render(before)}"
            )
    expected = f"PolicyCallError for each of {len(cases)} bad inputs"
    if wrong:
        return _result(
            "bad-input-is-an-error", False, expected, f"{len(wrong)} wrong",
            f"{len(wrong)} of {len(cases)} bad inputs were not a clean error: "
            + "; ".join(wrong[:5]) + ("; …" if len(wrong) > 5 else ""), t0,
        )
    return _result(
        "bad-input-is-an-error", True, expected, "all errors",
        f"{len(cases)} garbage/truncated inputs each gave PolicyCallError; the instance "
        "kept working", t0,
    )


def bad_params_are_refused(p: Probe) -> CaseResult:
    t0 = time.perf_counter()
    defaults = p.driver().instance.describe().params
    trials = [("unknown param", {**p.params, "no_such_param_xq": 1}, "no_such_param_xq")]
    if defaults:
        key = sorted(defaults)[0]
        trials.append((f"ill-typed param {key!r}", {**p.params, key: {"not": "a value"}}, key))
    wrong = []
    for label, params, key in trials:
        try:
            p.module.instantiate(params).close()
        except PolicyLoadError as exc:
            if key not in str(exc):
                wrong.append(f"{label}: refused, but the message does not name {key!r}: {exc}")
            continue
        wrong.append(f"{label}: init accepted {key}={params[key]!r}")
    if wrong:
        return _result(
            "bad-params-are-refused", False, "init refuses, naming the key",
            f"{len(wrong)} wrong", "; ".join(wrong), t0,
        )
    return _result(
        "bad-params-are-refused", True, "init refuses, naming the key", "refused",
        "unknown and ill-typed params are refused by init, naming the key", t0,
    )


def time_budget(p: Probe) -> CaseResult:
    t0 = time.perf_counter()
    d = p.driver()
    n = 1024
    snap = probe_snapshot(n, timestamp_ms=10_000)
    long_req = abi.Request(request_id="long", model="m", adapter="a1", prompt=_LONG_PROMPT)
    worst: dict[str, float] = {}

    def timed(label: str, fn: Callable[[], object]) -> None:
        s = time.perf_counter()
        fn()
        worst[label] = max(worst.get(label, 0.0), time.perf_counter() - s)

    try:
        for rep in range(10):
            snap_r = msgspec.structs.replace(snap, version=rep + 1, timestamp_ms=10_000 + 1_500 * rep)
            if d.resident:
                timed("set_snapshot", lambda: d.snapshot(snap_r))
            timed(d.use, lambda: d.call(snap_r, long_req, range(n)))
            if d.instance.has("pre_request"):
                ev = abi.PreRequestEvent(request=long_req, endpoint=_addr(rep), timestamp_ms=snap_r.timestamp_ms)
                timed("pre_request", lambda: d.pre_request(ev))
            if d.instance.has("post_response"):
                ev2 = abi.PostResponseEvent(request_id="long", adapter="a1", endpoint=_addr(rep))
                timed("post_response", lambda: d.post_response(ev2))
    except PolicyOutOfFuel as exc:
        return _result(
            "time-budget", False, f"within {exc.fuel:,} instructions", "out of fuel",
            f"with {n} endpoints and a {len(_LONG_PROMPT.encode())}-byte prompt: {exc.detail}", t0,
        )
    except PolicyTimeout as exc:
        return _result(
            "time-budget", False, f"within {exc.budget_ms:g} ms", "timeout",
            f"with {n} endpoints and a {len(_LONG_PROMPT.encode())}-byte prompt: {exc.detail}", t0,
        )
    seen = ", ".join(f"{k} {v * 1e6:.0f} µs" for k, v in worst.items())
    retried = (
        f"; {d.timeouts} sporadic deadline hit(s) passed on retry (a busy machine)"
        if d.timeouts else ""
    )
    return _result(
        "time-budget", True, "no call past its deadline", "none",
        f"heaviest inputs ({n} endpoints, {len(_LONG_PROMPT.encode())}-byte prompt) stayed "
        f"within the runtime's deadline; slowest wall time seen: {seen}{retried}", t0,
    )


def _memory_bytes(instance) -> int:
    """The instance's linear memory size in bytes (the runtime has no public accessor yet)."""
    size = getattr(instance, "memory_size", None)
    return size if size is not None else instance._memory.size


def memory_stable(p: Probe, calls: int = 10_000, warmup: int = 5_000) -> CaseResult:
    """Linear memory after ``calls`` calls is no larger than after ``warmup``.

    The first half is warm-up: hash maps and LRUs reach their working size (the shipped
    lora-affinity policy settles between 1,000 and 2,000 calls, then holds its size to
    200,000). A leak keeps growing through the second half. Memory grows in 64 KiB
    pages, so 5,000 calls reveal a leak of about 13 bytes a call or more.
    """
    t0 = time.perf_counter()
    d = p.driver()
    try:
        # 16 endpoints: every endpoint sees every probe request within the warm-up, so
        # legitimate state (a prefix LRU per endpoint, LoRA history) is full by then;
        # over 64 endpoints the prefix policy keeps filling LRUs until ~3,000 calls.
        at_warmup = _churn(d, calls, warmup, 16)
    except PolicyError as exc:
        return _result(
            "memory-stable", False, f"stable after {warmup} calls", "error",
            f"a bounded workload failed at call {d.calls}: {type(exc).__name__}: {exc}"
            " (a leak that reached the memory cap?)", t0,
        )
    end = _memory_bytes(d.instance)
    ok = end <= at_warmup
    return _result(
        "memory-stable", ok, f"{at_warmup} bytes after {warmup} calls",
        f"{end} bytes after {d.calls}",
        f"linear memory {at_warmup} bytes after {warmup} calls, {end} after {d.calls}"
        + ("" if ok else f": grew by {end - at_warmup} bytes"), t0,
    )


def _churn(d: Driver, calls: int, warmup: int, n: int) -> int:
    """A bounded workload of ``calls`` calls: a new snapshot every ~60 calls, the probe
    requests scored, each recorded with ``pre_request`` and completed with
    ``post_response`` (when exported) under a fresh request id. Nothing in it should
    make state grow without bound. Returns the memory size after ``warmup`` calls."""
    at_warmup = None
    version = 0
    snap = probe_snapshot(n)
    while d.calls < calls:
        if d.calls // 60 >= version:
            version += 1
            snap = msgspec.structs.replace(snap, version=version, timestamp_ms=1_000 + 250 * version)
        for k, req in enumerate(PROBE_REQUESTS):
            d.call(snap, req, range(n))
            rid = f"m{d.calls}"
            where = _addr((d.calls + k) % n)
            req_i = msgspec.structs.replace(req, request_id=rid)
            d.pre_request(
                abi.PreRequestEvent(request=req_i, endpoint=where, timestamp_ms=snap.timestamp_ms)
            )
            d.post_response(
                abi.PostResponseEvent(
                    request_id=rid, adapter=req.adapter, endpoint=where,
                    timestamp_ms=snap.timestamp_ms, model=req.model,
                )
            )
            if at_warmup is None and d.calls >= warmup:
                at_warmup = _memory_bytes(d.instance)
    return at_warmup


def reinit_resets_state(p: Probe) -> CaseResult:
    t0 = time.perf_counter()
    d = p.driver()
    fresh = p.script(d)
    dirty = p.script(d)  # the same calls again, now on top of the first run's history
    changed = sum(not np.array_equal(a, b) for a, b in zip(fresh, dirty))
    d.instance.init(p.params)
    d.forget_snapshot()
    again = p.script(d)
    first = _same(fresh, again)
    if first is not None:
        return _result(
            "reinit-resets-state", False, "a fresh instance's outputs", f"call {first} differs",
            f"after init, probe call {first} gave {render(again[first])}, a fresh instance "
            f"{render(fresh[first])}", t0,
        )
    note = (
        f"the history changed {changed} of {len(fresh)} outputs; init restored them all"
        if changed else "(the probe history does not change this policy's outputs)"
    )
    return _result(
        "reinit-resets-state", True, "a fresh instance's outputs", "same",
        f"init after a history gives a fresh instance's outputs: {note}", t0,
    )


def loads_like_the_host(p: Probe) -> CaseResult:
    """The smoke run the host makes before anything else goes live (``validate``; also
    the first check of LoadPolicy): so conformance and LoadPolicy name the same first
    problem in the same words."""
    from epick.runtime import PolicyLoadError, validate

    t0 = time.perf_counter()
    for attempt in range(3):
        try:
            validate(p.module, dict(p.params))
            break
        except PolicyLoadError as exc:
            # A deadline hit on a busy machine is retried, as every other call here is.
            if isinstance(exc.__cause__, PolicyTimeout) and attempt < 2:
                continue
            return _result("loads-like-the-host", False, "LoadPolicy's smoke run passes",
                           "refused", f"LoadPolicy would refuse it: {exc}", t0)
    return _result("loads-like-the-host", True, "LoadPolicy's smoke run passes", "passes",
                   "the host's smoke run (exports, ABI, init, counts, range, determinism) "
                   "passes", t0)


def carried_events_like_their_own_calls(p: Probe) -> CaseResult:
    """ABI v2: a pre_request event carried by the next score/filter call leaves the
    policy as its own call does (the standard script both ways: same outputs, same
    state)."""
    t0 = time.perf_counter()
    name, expected = "carried-events-like-their-own-calls", "the same outputs and state"
    d = p.driver()
    if getattr(d.instance, "abi_version", 1) < 2 or not d.has_pre_request:
        return _result(name, True, expected, "n/a",
                       "not applicable: a version 1 module, or no pre_request", t0)
    own = p.driver(carry=False)
    a, b = p.script(own), p.script(d)
    at = _same(a, b)
    if at is not None:
        return _result(name, False, expected, f"call {at} differs",
                       f"call {at} of the script gives {render(b[at])} with carried events, "
                       f"{render(a[at])} with each event its own call", t0)
    if own.instance.has("export_state") and own.instance.export_state() != d.instance.export_state():
        return _result(name, False, expected, "state differs",
                       "export_state after the script differs between carried events and "
                       "each event its own call", t0)
    return _result(name, True, expected, "same",
                   f"{len(a)} outputs and the exported state equal with carried events and "
                   "with each event its own call", t0)


PROPERTIES: tuple[Callable[[Probe], CaseResult], ...] = (
    loads_like_the_host,
    one_result_per_candidate,
    deterministic,
    candidate_counts,
    ignores_future_fields,
    resident_matches_inline,
    bad_input_is_an_error,
    bad_params_are_refused,
    time_budget,
    memory_stable,
    reinit_resets_state,
    carried_events_like_their_own_calls,
)


def _name(fn: Callable) -> str:
    return "property/" + fn.__name__.replace("_", "-")


#: Properties about init, not about what score/filter return: run once per module.
_EXPORT_FREE = (loads_like_the_host, bad_params_are_refused)


def _run_one(prop: Callable[[Probe], CaseResult], probe: Probe) -> CaseResult:
    t0 = time.perf_counter()
    try:
        return prop(probe)
    except Exception as exc:  # a policy error outside the property's own checks
        return CaseResult(
            name=_name(prop), expected="(no error)", got="(error)", verdict="error",
            why=f"{_name(prop)}: {type(exc).__name__}: {exc}", group="property",
            seconds=time.perf_counter() - t0,
        )


def run_properties(module, params: dict) -> list[CaseResult]:
    """Every property, each isolated: one that errors does not stop the others.

    A module exporting both ``score`` and ``filter`` gets the call-based properties
    twice; the ``filter`` rows are named ``property/<name> [filter]``.
    """
    exported = module.exports
    uses = [u for u in ("score", "filter") if u in exported] or ["score"]
    out = [_run_one(prop, Probe(module, dict(params), uses[0])) for prop in PROPERTIES]
    for use in uses[1:]:
        probe = Probe(module, dict(params), use)
        for prop in PROPERTIES:
            if prop in _EXPORT_FREE:
                continue
            r = _run_one(prop, probe)
            name = f"{r.name} [{use}]"
            why = r.why.replace(f"{r.name}: ", f"{name}: ", 1) if not r.passed else r.why
            out.append(dataclasses.replace(r, name=name, why=why))
    return out
