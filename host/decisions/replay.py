"""Replay a decision log through the real scheduler and runtime, with changes.

Every recorded decision, in order, goes through a real :class:`Scheduler` holding real
:class:`WasmPolicy` plugins on the recorded pool snapshots (the exact bytes the live
policies got), at the recorded clock; every recorded completion runs the post_response
hooks at its recorded time. So each policy's own state (LoRA history, prefix LRUs)
evolves as it did live — or, for a changed policy, as it would have on the same traffic.

Changes (:class:`Changes`): replace a policy's module, add a policy, set weights, set
params. Unchanged, a log replays to the same picks (``tests/decisions``).

Live accidents are mirrored: an unchanged policy that failed on a decision (a timeout
under load) fails there again, and live checkpoints and instance re-creations happen at
the same places. What a replay cannot know: the pool's reaction to different picks
(queues and caches are as recorded; ``epick bench quality --trace`` simulates that).
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from epick import abi
from epick.decisions import features, schema
from epick.interfaces import Capabilities, EndpointInfo, PluginError, PoolView
from epick.scheduler.filters import AdmissionFilter
from epick.scheduler.pickers import make_picker
from epick.scheduler.policyset import PolicyEntry, PolicySet
from epick.scheduler.scheduler import Scheduler, SchedulingError

__all__ = ["Changes", "Replayer", "ReplayError", "ReplayReport", "replay"]

_snapshot_decoder = msgspec.msgpack.Decoder(abi.Snapshot)

#: Scores closer than this are "the same" (the log keeps scores as f32).
SCORE_EPSILON = 1e-6
#: Per-endpoint LRU size of the prefix-locality estimate (the prefix policy's default).
LOCALITY_LRU_BLOCKS = 31_250


class ReplayError(ValueError):
    """The replay cannot run as asked (a module is missing, a change names no policy...)."""


@dataclass
class Changes:
    """What to change in the recorded policy set (all keyed by policy name)."""

    modules: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    """name -> (wasm bytes, where they came from): replace or add that policy's module."""
    weights: dict[str, float] = field(default_factory=dict)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    """name -> params merged over the recorded ones."""

    @property
    def empty(self) -> bool:
        return not (self.modules or self.weights or self.params)


class PolicyDelta(msgspec.Struct, frozen=True):
    policy: str
    compared: int
    """Candidate scores compared (recorded vs replayed)."""
    changed: int
    """Of those, how many differ by more than SCORE_EPSILON."""
    mean_abs: float
    max_abs: float
    mean: float
    """Mean signed delta (replayed − recorded): > 0 when the change scores higher."""


class ChangedDecision(msgspec.Struct, frozen=True):
    id: str
    t_ms: int
    model: str
    adapter: str
    recorded: str
    replayed: str
    margin: float
    """Replayed total of the replayed pick minus that of the recorded pick."""
    why: dict[str, list[float | None]]
    """Per policy: [recorded score at the recorded pick, replayed score at the recorded
    pick, replayed score at the replayed pick]; ``total`` holds the replayed totals."""


class ReplayReport(msgspec.Struct):
    files: list[str] = []
    decisions: int = 0
    completions: int = 0
    agreed: int = 0
    agreement: float = 1.0
    fallbacks_agreed: int = 0
    """Decisions whose whole answer (primary and fallbacks, in order) is the same."""
    replay_failed: dict[str, int] = {}
    """Recorded picks the replay refused (shed, unavailable)."""
    live_failures: int = 0
    """Decisions on which a live policy failed; an unchanged policy fails there again in
    the replay (the pick is made without it, as it was live)."""
    replay_policy_errors: dict[str, int] = {}
    lost_records: int = 0
    """Records the live writer dropped (gaps in the log)."""
    live_recoveries: int = 0
    """Times a live policy instance was re-created after a trap or timeout (its state
    went back to its last checkpoint); the replay does the same at the same place."""
    unknown_completions: int = 0
    cold_start: bool = False
    """The log starts mid-run: policies' state before it is unknown."""
    restarts: int = 0
    recorded_policies: list[str] = []
    replayed_policies: list[str] = []
    score_deltas: list[PolicyDelta] = []
    spread: dict[str, list[int]] = {}
    """endpoint -> [recorded picks, replayed picks]."""
    prefix_hit_estimate: list[float | None] = msgspec.field(default_factory=lambda: [None, None])
    """[recorded, replayed]: mean fraction of a prompt's leading blocks already sent to
    the picked endpoint (an LRU of LOCALITY_LRU_BLOCKS per endpoint)."""
    adapter_resident: list[float | None] = msgspec.field(default_factory=lambda: [None, None])
    """[recorded, replayed]: of adapter requests, the share picked where the snapshot
    listed the adapter as running."""
    endpoints_per_adapter: list[float | None] = msgspec.field(default_factory=lambda: [None, None])
    """[recorded, replayed]: mean number of endpoints each adapter's requests went to."""
    most_changed: list[ChangedDecision] = []
    seconds: float = 0.0
    """Time spent replaying, module compilation excluded (``compile_seconds``)."""
    compile_seconds: float = 0.0
    decisions_per_s: float = 0.0


class _Locality:
    """Host-side estimate of prefix and adapter locality for one stream of picks."""

    def __init__(self) -> None:
        self.lru: dict[str, OrderedDict[int, None]] = defaultdict(OrderedDict)
        self.hit_sum = 0.0
        self.hit_n = 0
        self.resident = 0
        self.adapter_n = 0
        self.adapter_eps: dict[str, set[str]] = defaultdict(set)

    def see(self, endpoint: str, hashes: tuple[int, ...], adapter: str,
            running: tuple[str, ...] | None) -> None:
        if hashes:
            lru = self.lru[endpoint]
            k = 0
            for h in hashes:
                if h not in lru:
                    break
                k += 1
            self.hit_sum += k / len(hashes)
            self.hit_n += 1
            for h in hashes:
                if h in lru:
                    lru.move_to_end(h)
                else:
                    lru[h] = None
            while len(lru) > LOCALITY_LRU_BLOCKS:
                lru.popitem(last=False)
        if adapter:
            self.adapter_n += 1
            self.resident += running is not None and adapter in running
            self.adapter_eps[adapter].add(endpoint)

    def hit(self) -> float | None:
        return self.hit_sum / self.hit_n if self.hit_n else None

    def resident_share(self) -> float | None:
        return self.resident / self.adapter_n if self.adapter_n else None

    def per_adapter(self) -> float | None:
        eps = self.adapter_eps
        return sum(len(v) for v in eps.values()) / len(eps) if eps else None


class _FailedLive:
    """A policy as it was on a decision where it failed live: its score/filter fail the
    same way (so the pick is made without it, as it was), its hooks run as usual."""

    def __init__(self, plugin, reason: str) -> None:
        self._plugin = plugin
        self._reason = reason
        self.name = plugin.name
        # a wrapper for one decision: it hands no state over
        self.capabilities = ((plugin.capabilities & ~Capabilities.STATE)
                             | Capabilities.SCORES_IN_RANGE)

    def score(self, cycle, candidates):
        raise PluginError(self.name, "score", _LIVE_FAILURE, self._reason)

    def filter(self, cycle, candidates):
        raise PluginError(self.name, "filter", _LIVE_FAILURE, self._reason)

    def pre_request(self, cycle, endpoint):
        self._plugin.pre_request(cycle, endpoint)

    def post_response(self, event):
        self._plugin.post_response(event)


_LIVE_FAILURE = "failed-live"


class _Recovering:
    """A policy whose live instance was re-created during this decision, at a stage the
    log does not say: during ``score`` (the scores were computed on the checkpoint's
    state) or during a hook (after scoring). The recorded scores tell which: if the
    current state reproduces them, the recovery comes after scoring."""

    def __init__(self, plugin, recorded: np.ndarray | None) -> None:
        self._plugin = plugin
        self._recorded = recorded
        self.done = False
        self.name = plugin.name
        # a wrapper for one decision: it hands no state over
        self.capabilities = ((plugin.capabilities & ~Capabilities.STATE)
                             | Capabilities.SCORES_IN_RANGE)

    def recover(self) -> None:
        if not self.done:
            self.done = True
            self._plugin.recover()

    def score(self, cycle, candidates):
        if not self.done:
            scores = self._plugin.score(cycle, candidates)
            rec = self._recorded
            if (rec is not None and len(rec) == len(scores)
                    and np.all(np.abs(scores - rec) <= SCORE_EPSILON)):
                return scores  # recovered later, in a hook
            self.recover()
        return self._plugin.score(cycle, candidates)

    def filter(self, cycle, candidates):
        self.recover()
        return self._plugin.filter(cycle, candidates)

    def pre_request(self, cycle, endpoint):
        self.recover()
        self._plugin.pre_request(cycle, endpoint)

    def post_response(self, event):
        self._plugin.post_response(event)


class _Recorded:
    """The assignment counts of one replayed decision (given to that ``schedule``
    call): the recorded per-candidate counts; the pick it makes changes nothing."""

    def __init__(self, counts: dict[str, tuple[int, int]], given: bool) -> None:
        self._counts, self._given = counts, given

    def of(self, addresses):
        if not self._given:
            return (), ()
        got = [self._counts.get(a, (0, 0)) for a in addresses]
        return tuple(c[0] for c in got), tuple(c[1] for c in got)

    def in_flight(self, address: str) -> int:
        return self._counts.get(address, (0, 0))[0]

    def picked_since_scrape(self, address: str) -> int:
        return self._counts.get(address, (0, 0))[1]

    def picked(self, address: str) -> None:
        pass

    def completed(self, address: str) -> None:
        pass

    def scraped(self, address: str) -> None:
        pass

    def __bool__(self) -> bool:
        return self._given


class _RecordedKv:
    """The KV counts of one replayed decision (given to that ``schedule`` call): the
    recorded per-candidate prefix counts (the engines' events are not in the log)."""

    def __init__(self, counts: dict[str, tuple[int, int]],
                 cleared: dict[str, int] | None = None) -> None:
        self._counts = counts
        self._cleared = cleared

    def counts(self, request, endpoints, candidates):
        got = [self._counts.get(endpoints[i].address, (0, -1)) for i in candidates]
        return tuple(c[0] for c in got), tuple(c[1] for c in got)

    def cleared(self, endpoints, candidates):
        if self._cleared is None:  # a log from before the field: nothing recorded
            return ()
        return tuple(self._cleared.get(endpoints[i].address, 0) for i in candidates)


class _Errors:
    """The replay scheduler's recorder: counts policy errors (not mirrored live ones)."""

    def __init__(self) -> None:
        self.errors: dict[str, int] = defaultdict(int)

    def policy_error(self, error: PluginError) -> None:
        if error.kind != _LIVE_FAILURE:
            self.errors[f"{error.plugin}: {error.kind}"] += 1

    def policy_latency(self, policy: str, seconds: float) -> None:
        pass

    def shadow(self, policy: str, agree: bool, delta: float) -> None:
        pass

    def stages(self, *a) -> None:
        pass

    def completion(self, *a) -> None:
        pass


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
        self._wasm: dict[str, bytes] = dict(modules or {})
        self._compiled: dict[str, Any] = {}
        self._builtins = False
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
        self._errors = _Errors()
        self._rec_loc = _Locality()
        self._rep_loc = _Locality()
        self._deltas: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0])
        self._changed: list[tuple[float, int, ChangedDecision]] = []
        self._spread: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self._seconds = 0.0
        self._compile_s = 0.0
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
            self._wasm.setdefault(rec.sha256, rec.wasm)
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
            assignments=_Recorded({}, False), kv=None,
            admission=AdmissionFilter(h.admission_queue, h.admission_kv),
            picker=make_picker(h.picker), recorder=self._errors,
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

    def _module(self, sha: str, name: str):
        mod = self._compiled.get(sha)
        if mod is not None:
            return mod
        wasm = self._wasm.get(sha)
        if wasm is None and not self._builtins:
            import hashlib

            from epick.config import BUILTIN_POLICY_DIR

            self._builtins = True
            for p in sorted(BUILTIN_POLICY_DIR.glob("*.wasm")):
                data = p.read_bytes()
                self._wasm.setdefault(hashlib.sha256(data).hexdigest(), data)
            wasm = self._wasm.get(sha)
        if wasm is None:
            raise ReplayError(
                f"policy {name!r}: module sha256 {sha[:12]}… is not in the log, nor a "
                f"built-in; give it with --policy {name}=FILE.wasm or --modules DIR")
        from epick.runtime import PolicyError

        t0 = time.perf_counter()
        try:
            mod = self.runtime.compile(wasm, name=name)
        except PolicyError as exc:
            raise ReplayError(f"policy {name!r}: {exc}") from None
        finally:
            self._compile_s += time.perf_counter() - t0
        self._compiled[sha] = mod
        return mod

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
                self._wasm.setdefault(sha, wasm)
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
                self._wasm.setdefault(sha, wasm)
                wanted.append((name, sha, dict(ch.params.get(name, {})),
                               ch.weights.get(name, 1.0), False))
        entries = []
        for name, sha, params, weight, shadow in wanted:
            if self._applied.get(name) == (sha, params) and name in current:
                plugin = current.get(name).plugin
            else:
                try:
                    plugin = WasmPolicy(self._module(sha, name), params, name=name,
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
        Returns the set and the :class:`_Recovering` wrappers to finish."""
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
                    w = _Recovering(plugin, np.frombuffer(blob, dtype="<f4")
                                    if blob is not None else None)
                    recovering.append(w)
                    plugin = w
            ref = recorded.get(e.name)
            unchanged = (ref is not None and e.name not in self.changes.modules
                         and e.name not in self.changes.params)
            if e.name in reasons and unchanged:
                plugin = _FailedLive(plugin, reasons[e.name])
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
            headers=dict(f.headers))
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
        assignments = _Recorded(
            {endpoints[c].address: (
                rec.in_flight[k] if rec.in_flight else 0,
                rec.picked_since_scrape[k] if rec.picked_since_scrape else 0)
             for k, c in enumerate(rec.candidates)},
            bool(rec.in_flight or rec.picked_since_scrape))
        kv = _RecordedKv(
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
        if not replay_id or not self._scheduler.complete(decision_id=replay_id,
                                                         status=rec.status):
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
        r.compile_seconds = self._compile_s
        r.seconds = self._seconds - self._compile_s
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
