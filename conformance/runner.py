"""Running vector cases against a compiled policy module.

Each case gets a fresh instance (``module.instantiate(case params)``), replays its
``before`` events in order, delivers the case's snapshot, makes one ``score`` or
``filter`` call and compares. Snapshot versions count up from 1 in the order the
snapshots are delivered; the case's own snapshot comes last.

A mismatch becomes a ``fail`` whose ``why`` names the case, the endpoint and the
derivation, e.g. ``lora/seed/room-boundary: endpoint 1 (e1:8000) expected 0.75
(room: |R∪W| = 1 < M = 2), got 0.5``. A policy that cannot run the case (it refused
the params, trapped, timed out) gives an ``error`` naming the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from epick import abi
from epick.conformance import stages
from epick.conformance.driver import Driver
from epick.conformance.report import CaseResult
from epick.conformance.schema import (
    Case,
    Check,
    Expect,
    Pick,
    PostResponse,
    PreRequest,
    SnapshotEvent,
    State,
    to_abi_request,
    to_abi_snapshot,
)
from epick.conformance.vectors import LoadedCase

__all__ = ["run_case", "run_cases", "fmt", "render"]


def fmt(x: float) -> str:
    """A score as people write it: 0.75, 0.333333, 1."""
    if isinstance(x, (bool, np.bool_)):
        return "keep" if x else "drop"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.6g}"


def render(values: Sequence) -> str:
    return "[" + ", ".join(fmt(v) for v in values) + "]"


class _StepError(Exception):
    def __init__(self, step: str, exc: BaseException) -> None:
        super().__init__(f"{step}: {type(exc).__name__}: {exc}")


def _replay(case: Case, params: dict, module) -> tuple[Driver, abi.Snapshot]:
    """A fresh instance brought to the case's state; returns it and the case's snapshot."""
    try:
        driver = Driver(module.instantiate(params))
    except Exception as exc:
        raise _StepError(f"init with params {params}", exc) from exc
    version = 0
    for i, ev in enumerate(case.before):
        step = f"before[{i}] ({type(ev).__name__})"
        try:
            version = _deliver(driver, ev, version)[0]
        except Exception as exc:
            raise _StepError(step, exc) from exc
    snap = to_abi_snapshot(
        case.snapshot.endpoints, version=version + 1, timestamp_ms=case.snapshot.timestamp_ms
    )
    return driver, snap


def _deliver(driver: Driver, ev, version: int) -> tuple[int, abi.Snapshot | None]:
    """Feed one event to the policy; returns the snapshot version now, and the snapshot
    when the event was one."""
    if isinstance(ev, SnapshotEvent):
        version += 1
        snap = to_abi_snapshot(ev.endpoints, version=version, timestamp_ms=ev.timestamp_ms)
        driver.snapshot(snap)
        return version, snap
    if isinstance(ev, PreRequest):
        driver.pre_request(abi.PreRequestEvent(
            request=to_abi_request(ev.request), endpoint=ev.endpoint,
            timestamp_ms=ev.timestamp_ms))
    elif isinstance(ev, PostResponse):
        driver.post_response(abi.PostResponseEvent(
            request_id=ev.request_id, adapter=ev.adapter, endpoint=ev.endpoint,
            status=ev.status, timestamp_ms=ev.timestamp_ms, model=ev.model, ttft_ms=ev.ttft_ms,
            prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens))
    return version, None


def _run_steps(driver: Driver, case: Case, snap: abi.Snapshot) -> tuple[list[str], abi.Snapshot]:
    """The case's steps, in order, after its snapshot is delivered; their differences,
    and the snapshot current at the end (the final ``expect`` call uses it)."""
    driver.snapshot(snap)
    version, diffs = snap.version, []
    for i, step in enumerate(case.steps):
        where = f"steps[{i}] ({step.__struct_config__.tag})"
        try:
            if isinstance(step, Check):
                cands = step.candidates if step.candidates is not None else tuple(
                    range(len(snap.endpoints)))
                request = to_abi_request(step.request)
                call = driver.score if step.expect.call == "score" else driver.filter
                got = call(snap, request, cands,
                           ((), (), step.prefix_blocks, step.prefix_matched))
                diffs += [f"{where}: {d}" for d in _compare_expect(
                    step.expect, got, cands, snap, lambda p, e=step.expect: _why_of(e, p))]
            elif isinstance(step, Pick):
                diffs += stages.check_pick(driver, snap, step, where)
            elif isinstance(step, State):
                diffs += stages.check_state(driver, step, where)
            else:
                version, new = _deliver(driver, step, version)
                snap = new or snap
        except Exception as exc:
            raise _StepError(where, exc) from exc
    return diffs, snap


def _why_of(e: Expect, position: int) -> str:
    return e.why[position] if isinstance(e.why, tuple) else e.why


def _compare(case: Case, got: np.ndarray, snap: abi.Snapshot | None = None) -> list[str]:
    """Plain-words differences between ``got`` and the case's expectation (empty: pass)."""
    snap = snap or to_abi_snapshot(case.snapshot.endpoints, version=0, timestamp_ms=0)
    return _compare_expect(case.expect, got, case.candidate_indices, snap, case.why)


def _compare_expect(e: Expect, got: np.ndarray, candidates, snap: abi.Snapshot,
                    why_of) -> list[str]:
    n = len(candidates)

    def _where(position: int) -> str:
        idx = candidates[position]
        return f"endpoint {idx} ({snap.endpoints[idx].address})"

    def _because(position: int) -> str:
        why = why_of(position)
        return f" ({why})" if why else ""

    if len(got) != n:
        return [f"expected {n} results (one per candidate), got {len(got)}"]
    diffs: list[str] = []
    if e.scores is not None:
        for p, (want, have) in enumerate(zip(e.scores, got)):
            if not (math.isfinite(have) and abs(have - want) <= e.tolerance):
                diffs.append(
                    f"{_where(p)} expected {fmt(want)}{_because(p)}, got {fmt(have)}"
                )
    elif e.order is not None:
        for a, b in zip(e.order, e.order[1:]):
            if not got[a] > got[b]:
                diffs.append(
                    f"{_where(a)}{_because(a)} should score above "
                    f"{_where(b)}{_because(b)}, got {fmt(got[a])} vs {fmt(got[b])}"
                )
    else:
        for p, (want, have) in enumerate(zip(e.keep, got)):
            if bool(want) != bool(have):
                diffs.append(
                    f"{_where(p)} expected {'kept' if want else 'dropped'}"
                    f"{_because(p)}, got {'kept' if have else 'dropped'}"
                )
    return diffs


def _expected_text(case: Case) -> str:
    if case.host is not None and case.stats is None:
        h = case.host.expect
        return f"outcome {h.outcome}" if h.outcome else f"pick {h.pick}"
    if case.stats is not None:
        return "shares [" + ", ".join(map(stages.fmt_share, case.stats.frequencies)) + "]"
    if case.expect is None:
        return f"{len(case.steps)} steps"
    e = case.expect
    if e.scores is not None:
        return render(e.scores)
    if e.order is not None:
        return "order " + " > ".join(str(case.candidate_indices[p]) for p in e.order)
    return render(e.keep)


def _error(case: Case, expected: str, exc: Exception, t0: float) -> CaseResult:
    return CaseResult(name=case.name, expected=expected, got="(error)", verdict="error",
                      why=f"{case.name}: {exc}", seconds=time.perf_counter() - t0)


def _done(case: Case, expected: str, got: str, diffs: list[str], passed_why: str,
          t0: float) -> CaseResult:
    return CaseResult(
        name=case.name, expected=expected, got=got, verdict="fail" if diffs else "pass",
        why=f"{case.name}: " + "; ".join(diffs) if diffs else passed_why,
        seconds=time.perf_counter() - t0,
    )


def _run_host(module, loaded: LoadedCase, runtime) -> CaseResult:
    case, t0 = loaded.case, time.perf_counter()
    expected = _expected_text(case)
    snap = to_abi_snapshot(case.snapshot.endpoints, version=1,
                           timestamp_ms=case.snapshot.timestamp_ms)
    try:
        diffs, got = stages.check_host(case, snap, module, runtime, loaded.source.parent,
                                       loaded.params)
    except Exception as exc:
        return _error(case, expected, _StepError("host stage", exc), t0)
    w = case.stats.why if case.stats is not None else case.host.expect.why
    return _done(case, expected, got, diffs, w if isinstance(w, str) else "; ".join(w), t0)


def run_case(module, loaded: LoadedCase, *, runtime=None) -> CaseResult:
    """Run one vector case on a fresh instance of ``module`` (host-stage cases build the
    scheduler instead; ``runtime`` compiles the modules they name)."""
    case = loaded.case
    if case.host is not None:
        return _run_host(module, loaded, runtime or module.runtime)
    t0 = time.perf_counter()
    expected = _expected_text(case)
    driver = None
    diffs: list[str] = []
    got = None
    try:
        driver, snap = _replay(case, loaded.params, module)
        if case.stats is not None:
            try:
                diffs, shares = stages.check_stats(driver, snap, case)
            except Exception as exc:
                raise _StepError("stats", exc) from exc
            got_text = "shares [" + ", ".join(map(stages.fmt_share, shares)) + "]"
        else:
            if case.steps:
                diffs, snap = _run_steps(driver, case, snap)
            got_text = "steps ok" if not diffs else "steps differ"
            if case.expect is not None:
                request = to_abi_request(case.request)
                call = case.expect.call
                try:
                    if call == "score":
                        got = driver.score(snap, request, case.candidate_indices, case.assigned)
                    else:
                        got = driver.filter(snap, request, case.candidate_indices, case.assigned)
                except Exception as exc:
                    raise _StepError(call, exc) from exc
                got_text = render(got)
    except _StepError as exc:
        if driver is not None:
            driver.instance.close()
        return _error(case, expected, exc, t0)
    driver.instance.close()
    if got is not None:
        diffs += _compare(case, got, snap)
    if case.stats is not None:
        w = case.stats.why
        why = w if isinstance(w, str) else "; ".join(
            f"{case.candidate_indices[p]}: {text}" for p, text in enumerate(w))
    elif case.expect is None:
        why = f"{len(case.steps)} steps as expected"
    else:
        w = case.expect.why
        why = w if isinstance(w, str) else "; ".join(
            f"{case.candidate_indices[p]}: {text}" for p, text in enumerate(w)
        )
    return _done(case, expected, got_text, diffs, why, t0)


def run_cases(module, cases: Sequence[LoadedCase], *, runtime=None) -> list[CaseResult]:
    return [run_case(module, c, runtime=runtime) for c in cases]
