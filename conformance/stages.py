"""What a case checks beyond one call: sequence steps, picks, state, statistics, the host.

    steps      events and checks in order, after the case's snapshot is delivered
    pick       filter (when exported) -> score -> the host's picker -> pre_request
    state      export_state, decoded as msgpack, walked by a path and compared
    stats      one request over many seeds: each candidate's share of the picks
    host       the real scheduler (host filters, filter policies, weighted sum, picker)

Each function returns plain-words differences (empty: pass), like ``runner._compare``.
The picker and the scheduler are the host's own (:mod:`epick.scheduler`), so a vector
pins what the service really does, not a copy of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np

from epick import abi
from epick.abi import Criticality
from epick.conformance.driver import Driver
from epick.conformance.schema import Case, HostPolicy, Pick, State, Stats, to_abi_request
from epick.interfaces import Capabilities, Cycle, EndpointInfo, PoolView
from epick.scheduler.filters import AdmissionFilter
from epick.scheduler.pickers import make_picker
from epick.scheduler.policyset import PolicyEntry, PolicySet
from epick.scheduler.scheduler import Scheduler, SchedulingError

__all__ = ["pick", "check_pick", "check_state", "check_stats", "check_host", "fmt_share"]


def fmt_share(x: float) -> str:
    return f"{x:.1%}"


# -- one policy, the way the host uses it ---------------------------------------------


def pick(driver: Driver, snap: abi.Snapshot, request: abi.Request,
         candidates: Sequence[int], picker: str) -> tuple[int | None, np.ndarray]:
    """The endpoint index the host would pick with this policy alone (None: shed), and
    the totals it picked from. No hooks run here."""
    cands = tuple(candidates)
    if driver.can_filter:
        keep = driver.filter(snap, request, cands)
        kept = tuple(c for c, k in zip(cands, keep) if k)
        if kept or request.criticality != Criticality.CRITICAL:
            cands = kept  # a critical request is never shed by a policy
    if not cands:
        return None, np.zeros(0)
    totals = (np.clip(driver.score(snap, request, cands), 0.0, 1.0) if driver.can_score
              else np.ones(len(cands)))
    order = make_picker(picker).pick(totals, 1, request.seed)
    return cands[order[0]], totals


def check_pick(driver: Driver, snap: abi.Snapshot, step: Pick, where: str) -> list[str]:
    """A pick step: pick, compare with ``expect``, then ``pre_request`` as the host does."""
    request = to_abi_request(step.request)
    cands = step.candidates if step.candidates is not None else range(len(snap.endpoints))
    chosen, totals = pick(driver, snap, request, cands, step.picker)
    if chosen is None:
        return [f"{where}: every candidate was filtered out (shed)"] if step.expect else []
    address = snap.endpoints[chosen].address
    driver.pre_request(abi.PreRequestEvent(request=request, endpoint=address,
                                           timestamp_ms=snap.timestamp_ms))
    if step.expect is not None and address != step.expect:
        because = f" ({step.why})" if step.why else ""
        scores = ", ".join(f"{v:.6g}" for v in totals)
        return [f"{where}: expected {step.expect} to be picked{because}, got {address} "
                f"(scores [{scores}])"]
    return []


def check_state(driver: Driver, step: State, where: str) -> list[str]:
    """A state step: the policy's ``export_state`` decoded, walked, compared."""
    if "export_state" not in driver.instance.exports:
        return [f"{where}: the policy does not export export_state (no observable state)"]
    value = msgspec.msgpack.decode(driver.instance.export_state())
    walked = "state"
    for key in step.path:
        try:
            value = value[key]
        except (IndexError, KeyError, TypeError):
            return [f"{where}: {walked} has no [{key!r}] (it is {_short(value)})"]
        walked += f"[{key!r}]"
    because = f" ({step.why})" if step.why else ""
    if step.length is not None:
        if not hasattr(value, "__len__") or len(value) != step.length:
            got = len(value) if hasattr(value, "__len__") else "no length"
            return [f"{where}: expected {walked} to have {step.length} elements{because}, "
                    f"got {got}: {_short(value)}"]
        return []
    if value != step.equals:
        return [f"{where}: expected {walked} = {step.equals!r}{because}, got {_short(value)}"]
    return []


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "…"


def _share_diffs(counts: np.ndarray, stats: Stats, labels: Sequence[str]) -> list[str]:
    shares = counts / stats.seeds
    diffs = []
    for p, (want, got) in enumerate(zip(stats.frequencies, shares)):
        if abs(got - want) > stats.tolerance:
            why = stats.why[p] if isinstance(stats.why, tuple) else stats.why
            because = f" ({why})" if why else ""
            diffs.append(f"{labels[p]} picked {fmt_share(got)} of {stats.seeds} seeds, "
                         f"expected {fmt_share(want)} ± {fmt_share(stats.tolerance)}{because}")
    return diffs


def check_stats(driver: Driver, snap: abi.Snapshot, case: Case) -> tuple[list[str], np.ndarray]:
    """A statistical case on one policy: picks over seeds; (differences, shares)."""
    stats = case.stats
    cands = case.candidate_indices
    position = {c: p for p, c in enumerate(cands)}
    counts = np.zeros(len(cands))
    base = to_abi_request(case.request)
    for seed in range(stats.first_seed, stats.first_seed + stats.seeds):
        chosen, _ = pick(driver, snap, msgspec.structs.replace(base, seed=seed), cands,
                         stats.picker)
        if chosen is not None:
            counts[position[chosen]] += 1
    labels = [f"endpoint {c} ({snap.endpoints[c].address})" for c in cands]
    return _share_diffs(counts, stats, labels), counts / stats.seeds


# -- the host stage ------------------------------------------------------------------


class FixedPolicy:
    """A host-stage stand-in with fixed per-endpoint scores or keep-mask: a real
    implementation of the extension point, so the host's arithmetic is what is checked."""

    def __init__(self, spec: HostPolicy) -> None:
        self.name = spec.name
        self._scores = None if spec.scores is None else np.asarray(spec.scores, dtype=float)
        self._keep = spec.keep
        self.capabilities = ((Capabilities.FILTER if spec.keep is not None else Capabilities.NONE)
                             | (Capabilities.SCORE if spec.scores is not None
                                else Capabilities.NONE))

    def score(self, cycle: Cycle, candidates: tuple[int, ...]) -> np.ndarray:
        return self._scores[list(candidates)]

    def filter(self, cycle: Cycle, candidates: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(c for c in candidates if self._keep[c])

    def close(self) -> None:
        pass


def _plugin(spec: HostPolicy, module, runtime, base: Path | None, params: dict):
    from epick.config import resolve_module
    from epick.runtime import WasmPolicy

    if spec.module is None:
        return FixedPolicy(spec)
    if spec.module == "self":
        if module is None:
            raise ValueError(f"host policy {spec.name!r} is `self`, but no module is under test")
        mod, merged = module, {**params, **spec.params}
    else:
        path = resolve_module(spec.module, base=base)
        mod = runtime.compile(path.read_bytes(), name=spec.name)
        merged = dict(spec.params)
    return WasmPolicy(mod, merged, name=spec.name, checkpoint_on_hooks=False)


def _scheduler(case: Case, view: PoolView, plugins: list) -> Scheduler:
    h = case.host
    entries = tuple(PolicyEntry(p.name, plugin, p.weight, p.shadow)
                    for p, plugin in zip(h.policies, plugins))
    return Scheduler(lambda: view, PolicySet(entries), fallbacks=h.fallbacks,
                     admission=AdmissionFilter(h.queue_threshold, h.kv_threshold),
                     picker=make_picker(h.picker))


def host_view(case: Case, snap: abi.Snapshot) -> PoolView:
    h = case.host
    info = []
    for e in snap.endpoints:
        pinned = h.serves.get(e.address, {})
        info.append(EndpointInfo(
            fresh=e.address not in h.stale,
            models=frozenset(pinned["models"]) if "models" in pinned else None,
            adapters=frozenset(pinned["adapters"]) if "adapters" in pinned else None,
        ))
    return PoolView.build(snap, info)


def check_host(case: Case, snap: abi.Snapshot, module, runtime, base: Path | None,
               params: dict) -> tuple[list[str], str]:
    """A host-stage case: (differences, what was decided, in words)."""
    view = host_view(case, snap)
    plugins = [_plugin(p, module, runtime, base, params) for p in case.host.policies]
    try:
        request = to_abi_request(case.request)
        if case.stats is not None:
            return _host_stats(case, snap, view, plugins, module, runtime, base, params)
        return _host_once(case, snap, _scheduler(case, view, plugins), request)
    finally:
        for plugin in plugins:
            plugin.close()


def _host_once(case: Case, snap, scheduler: Scheduler, request) -> tuple[list[str], str]:
    e = case.host.expect
    because = f" ({e.why})" if e.why else ""
    try:
        decision = scheduler.schedule(request, explain=True)
    except SchedulingError as exc:
        if e.outcome == exc.outcome:
            return [], f"{exc.outcome}: {exc}"
        want = e.outcome or f"a pick of {e.pick}"
        return [f"expected {want}{because}, got {exc.outcome}: {exc}"], exc.outcome
    got = f"{decision.endpoint} then {decision.fallbacks}"
    if decision.skipped:
        got += f" (skipped policies: {'; '.join(decision.skipped)})"
    if e.outcome is not None:
        return [f"expected {e.outcome}{because}, got a pick of {decision.endpoint}"], got
    diffs = []
    if decision.endpoint != e.pick:
        diffs.append(f"expected {e.pick} to be picked{because}, got {decision.endpoint}")
    if e.fallbacks is not None and tuple(decision.fallbacks) != e.fallbacks:
        diffs.append(f"expected fallbacks {list(e.fallbacks)}, got {decision.fallbacks}")
    rows = {row.endpoint: row for row in decision.explanation}
    if e.totals is not None:
        for ep, want in zip(snap.endpoints, e.totals):
            have = rows[ep.address].total
            if abs(have - want) > e.tolerance:
                diffs.append(f"{ep.address}: expected total {want:.6g}, got {have:.6g} "
                             f"(scores {rows[ep.address].scores})")
    if e.filtered is not None:
        for ep in snap.endpoints:
            want = e.filtered.get(ep.address, "")
            have = rows[ep.address].filtered_by
            if want != have:
                diffs.append(f"{ep.address}: expected "
                             f"{'to be removed by ' + repr(want) if want else 'to survive'}, "
                             f"got {'removed by ' + repr(have) if have else 'kept'}")
    return diffs, got


def _host_stats(case: Case, snap, view, plugins, module, runtime, base, params):
    stats = case.stats
    counts = np.zeros(len(snap.endpoints))
    index = {e.address: i for i, e in enumerate(snap.endpoints)}
    base_request = to_abi_request(case.request)
    # Hooks record every pick; draws must be independent, so a policy with history gets
    # a fresh instance per seed.
    stateful = [Capabilities.PRE_REQUEST in p.capabilities for p in plugins]
    for seed in range(stats.first_seed, stats.first_seed + stats.seeds):
        if any(stateful):
            for i, spec in enumerate(case.host.policies):
                if stateful[i]:
                    plugins[i].close()
                    plugins[i] = _plugin(spec, module, runtime, base, params)
        scheduler = _scheduler(case, view, plugins)
        try:
            decision = scheduler.schedule(msgspec.structs.replace(base_request, seed=seed))
        except SchedulingError:
            continue
        counts[index[decision.endpoint]] += 1
    labels = [f"endpoint {i} ({e.address})" for i, e in enumerate(snap.endpoints)]
    shares = counts / stats.seeds
    return _share_diffs(counts, stats, labels), "[" + ", ".join(map(fmt_share, shares)) + "]"
