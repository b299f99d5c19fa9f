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
from epick.conformance.driver import Driver
from epick.conformance.report import CaseResult
from epick.conformance.schema import (
    Case,
    PostResponse,
    PreRequest,
    SnapshotEvent,
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
            if isinstance(ev, SnapshotEvent):
                version += 1
                driver.snapshot(
                    to_abi_snapshot(ev.endpoints, version=version, timestamp_ms=ev.timestamp_ms)
                )
            elif isinstance(ev, PreRequest):
                driver.pre_request(
                    abi.PreRequestEvent(
                        request=to_abi_request(ev.request),
                        endpoint=ev.endpoint,
                        timestamp_ms=ev.timestamp_ms,
                    )
                )
            elif isinstance(ev, PostResponse):
                driver.post_response(
                    abi.PostResponseEvent(
                        request_id=ev.request_id,
                        adapter=ev.adapter,
                        endpoint=ev.endpoint,
                        status=ev.status,
                        timestamp_ms=ev.timestamp_ms,
                        model=ev.model,
                    )
                )
        except Exception as exc:
            raise _StepError(step, exc) from exc
    snap = to_abi_snapshot(
        case.snapshot.endpoints, version=version + 1, timestamp_ms=case.snapshot.timestamp_ms
    )
    return driver, snap


def _where(case: Case, position: int) -> str:
    idx = case.candidate_indices[position]
    return f"endpoint {idx} ({case.snapshot.endpoints[idx].address})"


def _because(case: Case, position: int) -> str:
    why = case.why(position)
    return f" ({why})" if why else ""


def _compare(case: Case, got: np.ndarray) -> list[str]:
    """Plain-words differences between ``got`` and the case's expectation (empty: pass)."""
    e = case.expect
    n = len(case.candidate_indices)
    if len(got) != n:
        return [f"expected {n} results (one per candidate), got {len(got)}"]
    diffs: list[str] = []
    if e.scores is not None:
        for p, (want, have) in enumerate(zip(e.scores, got)):
            if not (math.isfinite(have) and abs(have - want) <= e.tolerance):
                diffs.append(
                    f"{_where(case, p)} expected {fmt(want)}{_because(case, p)}, got {fmt(have)}"
                )
    elif e.order is not None:
        for a, b in zip(e.order, e.order[1:]):
            if not got[a] > got[b]:
                diffs.append(
                    f"{_where(case, a)}{_because(case, a)} should score above "
                    f"{_where(case, b)}{_because(case, b)}, got {fmt(got[a])} vs {fmt(got[b])}"
                )
    else:
        for p, (want, have) in enumerate(zip(e.keep, got)):
            if bool(want) != bool(have):
                diffs.append(
                    f"{_where(case, p)} expected {'kept' if want else 'dropped'}"
                    f"{_because(case, p)}, got {'kept' if have else 'dropped'}"
                )
    return diffs


def _expected_text(case: Case) -> str:
    e = case.expect
    if e.scores is not None:
        return render(e.scores)
    if e.order is not None:
        return "order " + " > ".join(str(case.candidate_indices[p]) for p in e.order)
    return render(e.keep)


def run_case(module, loaded: LoadedCase) -> CaseResult:
    """Run one vector case on a fresh instance of ``module``."""
    case = loaded.case
    t0 = time.perf_counter()
    expected = _expected_text(case)
    driver = None
    try:
        driver, snap = _replay(case, loaded.params, module)
        request = to_abi_request(case.request)
        call = case.expect.call
        try:
            if call == "score":
                got = driver.score(snap, request, case.candidate_indices, case.assigned)
            else:
                got = driver.filter(snap, request, case.candidate_indices, case.assigned)
        except Exception as exc:
            raise _StepError(call, exc) from exc
    except _StepError as exc:
        if driver is not None:
            driver.instance.close()
        return CaseResult(
            name=case.name,
            expected=expected,
            got="(error)",
            verdict="error",
            why=f"{case.name}: {exc}",
            seconds=time.perf_counter() - t0,
        )
    driver.instance.close()
    diffs = _compare(case, got)
    seconds = time.perf_counter() - t0
    if diffs:
        why = f"{case.name}: " + "; ".join(diffs)
    else:
        w = case.expect.why
        why = w if isinstance(w, str) else "; ".join(
            f"{case.candidate_indices[p]}: {text}" for p, text in enumerate(w)
        )
    return CaseResult(
        name=case.name,
        expected=expected,
        got=render(got),
        verdict="fail" if diffs else "pass",
        why=why,
        seconds=seconds,
    )


def run_cases(module, cases: Sequence[LoadedCase]) -> list[CaseResult]:
    return [run_case(module, c) for c in cases]
