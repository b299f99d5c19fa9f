"""The replayer: feeds a log's records through a real :class:`Scheduler` holding real
:class:`WasmPolicy` plugins, mirroring live accidents, and builds the report."""

from __future__ import annotations

import heapq
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import numpy as np

from epick import abi
from epick.decisions import features, schema
from epick.decisions.replay.changes import Changes, ReplayError
from epick.decisions.replay.locality import Locality
from epick.decisions.replay.modules import Modules
from epick.decisions.replay.report import (
    SCORE_EPSILON,
    ChangedDecision,
    PolicyDelta,
    ReplayReport,
)
from epick.decisions.replay.standins import (
    ErrorCount,
    FailedLive,
    RecordedCounts,
    RecordedKv,
    Recovering,
)
from epick.interfaces import Capabilities, EndpointInfo, PoolView
from epick.scheduler.filters import AdmissionFilter
from epick.scheduler.pickers import make_picker
from epick.scheduler.policyset import PolicyEntry, PolicySet
from epick.scheduler.scheduler import Scheduler, SchedulingError

__all__ = ["Replayer", "replay"]

_snapshot_decoder = msgspec.msgpack.Decoder(abi.Snapshot)


class Replayer:
    """Feed it a log's records in order (:meth:`feed`), then read :meth:`report`.

    ``runtime`` compiles the modules (use a generous ``budget_ms``: a replay is offline
    and a timeout would change a pick). ``modules`` adds wasm bytes by sha256 to those
    the log embeds (and the built-in policies, always found).
    """

    def __init__(self, runtime, changes: Changes | None = None, *, top: int = 10,
                 modules: dict[str, bytes] | None = None) -> None:
        self.runtime = runtime
        self.changes = changes or Changes()
        self.top = top
        self._modules = Modules(runtime, modules)
        self._header: schema.Header | None = None
        self._scheduler: Scheduler | None = None
        self._view: PoolView | None = None
        self._views: dict[int, tuple[PoolView, dict[str, tuple[str, ...]]]] = {}
        self._policy_sets: dict[int, tuple[schema.PolicyRef, ...]] = {}
        self._current_refs: tuple[schema.PolicyRef, ...] | None = None
        self._rec_weights: dict[str, float] = {}
        self._pending_recovery: set[str] = set()
        self._applied: dict[str, tuple[str, dict]] = {}
        self._ids: dict[str, str] = {}
        self._now_s = 0.0
        self._errors = ErrorCount()
        self._rec_loc = Locality()
        self._rep_loc = Locality()
        self._deltas: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0])
        self._changed: list[tuple[float, int, ChangedDecision]] = []
        self._spread: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self._seconds = 0.0
        self.r = ReplayReport()

    # -- records ------------------------------------------------------------------------

    def feed(self, rec: schema.Record) -> None:
        t0 = time.perf_counter()
        if isinstance(rec, schema.DecisionRec):
            self._decision(rec)
        elif isinstance(rec, schema.CompletionRec):
            self._completion(rec)
        elif isinstance(rec, schema.SnapshotRec):
            self._snapshot(rec)
        elif isinstance(rec, schema.Policies):
            self._policy_sets[rec.id] = rec.entries
        elif isinstance(rec, schema.Module):
            self._modules.add(rec.sha256, rec.wasm)
        elif isinstance(rec, schema.Header):
            self._start(rec)
        elif isinstance(rec, schema.Gap):
            self.r.lost_records += rec.lost
        elif isinstance(rec, schema.Checkpoint):
            self._plugin_call(rec.policy, "checkpoint")
        elif isinstance(rec, schema.Recovered):
            self.r.live_recoveries += 1
            self._pending_recovery.add(rec.policy)  # done in the next decision/completion
        self._seconds += time.perf_counter() - t0

    def _start(self, h: schema.Header) -> None:
        prev = self._header
        self._header = h
        if prev is not None and prev.boot == h.boot:
            return  # a rotation: the same process, policies keep their state
        if prev is None:
            self.r.cold_start = not h.fresh_start
        else:
            self.r.restarts += 1
        self._close_policies()
        self._scheduler = Scheduler(
            lambda: self._view, PolicySet(), fallbacks=h.fallbacks,
            # Counts come from the log, one decision at a time (given to each schedule).
            assignments=RecordedCounts({}, False), kv=None,
            admission=AdmissionFilter(h.admission_queue, h.admission_kv),
            picker=make_picker(h.picker), work_conserving=h.work_conserving,
            recorder=self._errors,
            # Expire decisions on the recorded clock, with slack: a completion the live
            # service knew must stay known here.
            decision_ttl_s=h.decision_ttl_s + 60.0, max_decisions=1 << 40,
            clock=lambda: self._now_s, wall_clock=lambda: self._now_s)
        self._current_refs = None
        self._applied = {}
        self._ids = {}
        self._views = {}

    def _snapshot(self, rec: schema.SnapshotRec) -> None:
        snap = _snapshot_decoder.decode(rec.encoded)
        info = tuple(EndpointInfo(
            fresh=f.fresh,
            models=frozenset(f.models) if f.models is not None else None,
            adapters=frozenset(f.adapters) if f.adapters is not None else None,
        ) for f in rec.facts)
        view = PoolView(
            snapshot=snap, encoded=rec.encoded, info=info,
            fresh=tuple(i for i, e in enumerate(info) if e.fresh),
            restricted=any(e.models is not None or e.adapters is not None for e in info),
            addresses=tuple(e.address for e in snap.endpoints))
        running = {e.address: e.running_adapters for e in snap.endpoints}
        self._views[rec.version] = (view, running)
        if len(self._views) > 64:
            self._views.pop(next(iter(self._views)))

    # -- policies ---------------------------------------------------------------------------

    def _use_policies(self, pid: int) -> None:
        refs = self._policy_sets.get(pid)
        if refs is None:
            raise ReplayError(f"decision refers to policy set {pid}, which the log lacks")
        if refs is self._current_refs:
            return
        import hashlib

        from epick.runtime import PolicyError, WasmPolicy

        ch = self.changes
        sched = self._scheduler
        current = sched.policies
        wanted: list[tuple[str, str, dict, float, bool]] = []
        for ref in refs:
            sha = ref.sha256
            if ref.name in ch.modules:
                wasm, _source = ch.modules[ref.name]
                sha = hashlib.sha256(wasm).hexdigest()
                self._modules.add(sha, wasm)
            elif not sha:
                raise ReplayError(f"policy {ref.name!r} is not a WASM module: it cannot be "
                                  f"replayed; replace it with --policy {ref.name}=FILE.wasm")
            params = {**ref.params, **ch.params.get(ref.name, {})}
            wanted.append((ref.name, sha, params, ch.weights.get(ref.name, ref.weight),
                           ref.shadow))
        recorded = {ref.name for ref in refs}
        known = recorded | set(ch.modules)
        for option, names in (("--weights", ch.weights), ("--params", ch.params)):
            for name in names:
                if name not in known:
                    raise ReplayError(
                        f"{option} names policy {name!r}, which is neither in the log's "
                        f"policy set ({', '.join(sorted(recorded))}) nor added with "
                        f"--policy {name}=FILE.wasm")
        for name, (wasm, _source) in ch.modules.items():
            if name not in recorded:
                sha = hashlib.sha256(wasm).hexdigest()
                self._modules.add(sha, wasm)
                wanted.append((name, sha, dict(ch.params.get(name, {})),
                               ch.weights.get(name, 1.0), False))
        entries = []
        for name, sha, params, weight, shadow in wanted:
            if self._applied.get(name) == (sha, params) and name in current:
                plugin = current.get(name).plugin
            else:
                try:
                    plugin = WasmPolicy(self._modules.compiled(sha, name), params, name=name,
                                        checkpoint_on_hooks=False)
                except PolicyError as exc:
                    raise ReplayError(f"policy {name!r}: {exc}") from None
                if name in current:  # a live swap: hand state over, as the service does
                    old = current.get(name).plugin
                    if Capabilities.STATE in old.capabilities & plugin.capabilities:
                        try:
                            state = old.export_state()
                            if state:
                                plugin.import_state(state)
                        except PolicyError:
                            pass
                self._applied[name] = (sha, params)
            entries.append(PolicyEntry(name, plugin, weight=weight, shadow=shadow))
        for e in current.entries:
            if e.name not in {w[0] for w in wanted}:
                self._applied.pop(e.name, None)
        sched.policies = PolicySet(tuple(entries))
        self._current_refs = refs
        self._rec_weights = {r.name: r.weight for r in refs if not r.shadow}
        self.r.recorded_policies = [
            f"{r.name} w={r.weight:g}{' shadow' if r.shadow else ''} {r.sha256[:12]}"
            for r in refs]
        self.r.replayed_policies = [
            f"{n} w={w:g}{' shadow' if s else ''} {sha[:12]}"
            + (f" params={p}" if p else "") for n, sha, p, w, s in wanted]

    def _accidents(self, policies: PolicySet, rec: schema.DecisionRec):
        """``policies`` for this decision with the live accidents mirrored: an unchanged
        policy that failed live fails again (a changed policy's failures are its own),
        and one whose live instance was re-created here is re-created at the same stage.
        Returns the set and the :class:`Recovering` wrappers to finish."""
        reasons = {}
        for text in rec.skipped:
            name, _, reason = text.partition(": ")
            reasons[name] = reason
        recorded = {r.name: r for r in self._current_refs or ()}
        pending, self._pending_recovery = self._pending_recovery, set()
        entries, recovering = [], []
        for e in policies.entries:
            plugin = e.plugin
            if e.name in pending and hasattr(plugin, "recover"):
                if e.name in reasons:
                    plugin.recover()  # its failed call re-created it before failing
                else:
                    blob = rec.scores.get(e.name)
                    w = Recovering(plugin, np.frombuffer(blob, dtype="<f4")
                                    if blob is not None else None)
                    recovering.append(w)
                    plugin = w
            ref = recorded.get(e.name)
            unchanged = (ref is not None and e.name not in self.changes.modules
                         and e.name not in self.changes.params)
            if e.name in reasons and unchanged:
                plugin = FailedLive(plugin, reasons[e.name])
            if plugin is not e.plugin:
                e = PolicyEntry(e.name, plugin, weight=e.weight, shadow=e.shadow)
            entries.append(e)
        return PolicySet(tuple(entries)), recovering

    def _plugin_call(self, name: str, what: str) -> None:
        sched = self._scheduler
        if sched is None or name not in sched.policies:
            return
        plugin = sched.policies.get(name).plugin
        if what == "checkpoint" and hasattr(plugin, "checkpoint"):
            plugin.checkpoint(force=True)
        elif what == "recover" and hasattr(plugin, "recover"):
            plugin.recover()

    def _close_policies(self) -> None:
        if self._scheduler is None:
            return
        for e in self._scheduler.policies.entries:
            close = getattr(e.plugin, "close", None)
            if close is not None:
                close()

    def close(self) -> None:
        self._close_policies()

    # -- decisions ------------------------------------------------------------------------

    def _decision(self, rec: schema.DecisionRec) -> None:
        h = self._header
        if h is None or self._scheduler is None:
            raise ReplayError("a decision before the log's header")
        got = self._views.get(rec.snapshot)
        if got is None:
            raise ReplayError(f"decision {rec.id} refers to snapshot {rec.snapshot}, which "
                              "the log lacks")
        view, running = got
        self._use_policies(rec.policies)
        self._view = view
        self._now_s = (rec.t_ms + 0.5) / 1000.0
        f = rec.request
        hashes: tuple[int, ...] = ()
        if f.prompt is not None:
            prompt = f.prompt
            hashes = tuple(features.block_hashes(f.model, f.cache_salt, prompt,
                                                 h.block_bytes, h.max_blocks))
        elif f.blocks:
            hashes = features.unpack_hashes(f.blocks)
            prompt = features.synthetic_prompt(hashes, h.block_bytes)
        else:
            prompt = ""
        request = abi.Request(
            request_id=f.request_id, model=f.model, adapter=f.adapter, prompt=prompt,
            criticality=f.criticality, seed=f.seed, cache_salt=f.cache_salt,
            headers=dict(f.headers), slo_ttft_ms=f.slo_ttft_ms, slo_tpot_ms=f.slo_tpot_ms,
            prompt_tokens=f.prompt_tokens, session_id=f.session_id)
        endpoints = view.snapshot.endpoints
        recorded = [endpoints[i].address for i in rec.picked]
        r = self.r
        r.decisions += 1
        if rec.skipped:
            r.live_failures += 1
        self._spread[recorded[0]][0] += 1
        self._rec_loc.see(recorded[0], hashes, f.adapter, running.get(recorded[0]))
        sched = self._scheduler
        policies, recovering = sched.policies, []
        if rec.skipped or self._pending_recovery:
            policies, recovering = self._accidents(policies, rec)
        # The host's own assignment counts depend on scrapes the log does not hold: the
        # policies get exactly what they saw live (and this pick changes nothing).
        assignments = RecordedCounts(
            {endpoints[c].address: (
                rec.in_flight[k] if rec.in_flight else 0,
                rec.picked_since_scrape[k] if rec.picked_since_scrape else 0)
             for k, c in enumerate(rec.candidates)},
            bool(rec.in_flight or rec.picked_since_scrape))
        kv = RecordedKv(
            {endpoints[c].address: (rec.prefix_blocks[k], rec.prefix_matched[k])
             for k, c in enumerate(rec.candidates)},
            {endpoints[c].address: rec.prefix_cleared_ms[k]
             for k, c in enumerate(rec.candidates)} if rec.prefix_cleared_ms else None,
        ) if rec.prefix_blocks else None  # the replay scheduler's own kv is None: off
        try:
            d = sched.schedule(request, explain=True, policies=policies,
                               assignments=assignments, kv=kv)
        except SchedulingError as exc:
            r.replay_failed[exc.outcome] = r.replay_failed.get(exc.outcome, 0) + 1
            self._note_changed(rec, recorded[0], f"({exc.outcome})", float("inf"), {})
            return
        finally:
            for w in recovering:  # a recovery in a hook the policy does not have
                w.recover()
        self._ids[rec.id] = d.decision_id
        replayed = [d.endpoint, *d.fallbacks]
        self._spread[d.endpoint][1] += 1
        self._rep_loc.see(d.endpoint, hashes, f.adapter, running.get(d.endpoint))
        if replayed[0] == recorded[0]:
            r.agreed += 1
        if replayed == recorded:
            r.fallbacks_agreed += 1
        rows = {c.endpoint: c for c in d.explanation or ()}
        n = len(rec.candidates)
        for name, blob in rec.scores.items():
            old = np.frombuffer(blob, dtype="<f4")
            if len(old) != n:
                raise ReplayError(f"decision {rec.id}: {len(old)} scores of {name!r} for "
                                  f"{n} candidates")
            acc = self._deltas[name]
            for pos, idx in enumerate(rec.candidates):
                row = rows.get(endpoints[idx].address)
                if row is None or name not in row.scores and name not in row.shadow_scores:
                    continue
                new = row.scores.get(name, row.shadow_scores.get(name))
                delta = new - float(old[pos])
                acc[0] += 1
                acc[1] += abs(delta) > SCORE_EPSILON
                acc[2] += abs(delta)
                acc[3] = max(acc[3], abs(delta))
                acc[4] += delta
        if replayed[0] != recorded[0]:
            rec_row = rows.get(recorded[0])
            rep_row = rows[replayed[0]]
            # A recorded pick the replay filtered out has no total to compare: inf.
            margin = (rep_row.total - rec_row.total if rec_row and not rec_row.filtered_by
                      else float("inf"))
            why: dict[str, list[float | None]] = {}
            pos_of = {endpoints[i].address: p for p, i in enumerate(rec.candidates)}
            names = list(dict.fromkeys([*rec.scores, *rep_row.scores]))
            for name in names:
                blob = rec.scores.get(name)
                p = pos_of.get(recorded[0])
                was = (float(np.frombuffer(blob, dtype="<f4")[p])
                       if blob is not None and p is not None else None)
                why[name] = [was, rec_row.scores.get(name) if rec_row else None,
                             rep_row.scores.get(name)]
            was_total = sum(w * why[n][0] for n, w in self._rec_weights.items()
                            if n in why and why[n][0] is not None)
            why["total"] = [was_total, rec_row.total if rec_row else None, rep_row.total]
            self._note_changed(rec, recorded[0], replayed[0], margin, why)

    def _note_changed(self, rec, recorded: str, replayed: str, margin: float, why) -> None:
        item = ChangedDecision(id=rec.id, t_ms=rec.t_ms, model=rec.request.model,
                               adapter=rec.request.adapter, recorded=recorded,
                               replayed=replayed, margin=margin, why=why)
        entry = (margin, self.r.decisions, item)
        if len(self._changed) < self.top:
            heapq.heappush(self._changed, entry)
        elif self.top:
            heapq.heappushpop(self._changed, entry)

    def _completion(self, rec: schema.CompletionRec) -> None:
        if self._scheduler is None:
            return
        self.r.completions += 1
        self._now_s = (rec.t_ms + 0.5) / 1000.0
        # A recovery noticed with a completion happened in its hooks (or just before):
        # live retried the hook on the re-created instance, so recover, then run it.
        for name in self._pending_recovery:
            self._plugin_call(name, "recover")
        self._pending_recovery = set()
        replay_id = self._ids.pop(rec.id, "")
        if not replay_id or not self._scheduler.complete(
                decision_id=replay_id, status=rec.status, prompt_tokens=rec.prompt_tokens,
                completion_tokens=rec.completion_tokens, ttft_s=rec.ttft_s):
            self.r.unknown_completions += 1

    # -- the report -----------------------------------------------------------------------

    def report(self) -> ReplayReport:
        r = self.r
        r.agreement = r.agreed / r.decisions if r.decisions else 1.0
        r.replay_policy_errors = dict(self._errors.errors)
        r.score_deltas = [
            PolicyDelta(policy=name, compared=int(a[0]), changed=int(a[1]),
                        mean_abs=a[2] / a[0] if a[0] else 0.0, max_abs=a[3],
                        mean=a[4] / a[0] if a[0] else 0.0)
            for name, a in self._deltas.items()]
        r.spread = {k: v for k, v in sorted(self._spread.items())}
        r.prefix_hit_estimate = [self._rec_loc.hit(), self._rep_loc.hit()]
        r.adapter_resident = [self._rec_loc.resident_share(), self._rep_loc.resident_share()]
        r.endpoints_per_adapter = [self._rec_loc.per_adapter(), self._rep_loc.per_adapter()]
        r.most_changed = [e[2] for e in sorted(self._changed, key=lambda e: (-e[0], e[1]))]
        r.compile_seconds = self._modules.compile_seconds
        r.seconds = self._seconds - r.compile_seconds
        r.decisions_per_s = r.decisions / r.seconds if r.seconds > 0 else 0.0
        return r


def replay(paths: list[str | Path], changes: Changes | None = None, *, runtime=None,
           top: int = 10, modules: dict[str, bytes] | None = None) -> ReplayReport:
    """Replay the logs at ``paths`` (rotated files included) and return the report."""
    from epick.decisions.reader import log_files, read_file
    from epick.runtime import Limits, Runtime

    own = runtime is None
    if own:
        # The service's compiled-module cache; a generous budget: a replay is offline.
        runtime = Runtime(Limits(budget_ms=100.0), cache_dir=Path.home() / ".cache" / "epick")
    replayer = Replayer(runtime, changes, top=top, modules=modules)
    try:
        files = log_files(paths)
        replayer.r.files = [str(f) for f in files]
        for f in files:
            for rec in read_file(f):
                replayer.feed(rec)
        return replayer.report()
    finally:
        replayer.close()
        if own:
            runtime.close()
