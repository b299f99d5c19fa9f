"""Turning modules into live policies, and swapping them while serving.

Every way a policy goes live — the config file at start or reload
(:meth:`PolicyManager.replace_all`), the watched policy directory, saved admin loads and
the admin API (:meth:`PolicyManager.activate` / ``activate_async``) — takes the same
steps, and the last one is the same code, :meth:`PolicyManager._commit`:

    compile -> validate (exports, ABI, init, smoke run: judged on fuel)   (vet)
      -> conformance gate (hot loads only; shadow may be exempt by config; fuel again)
      -> the live instance is made          (prepare; all of this: on a worker thread)
      -> hand state over from the policy it replaces (export_state -> import_state)
      -> _commit: one assignment of a new PolicySet to the scheduler and of the record
         of what is live (``active``: one :class:`ActivePolicy` per live policy, with
         its ``origin``); plugins that left are closed, unused compiled code dropped

A module that fails any step raises :class:`PolicyRejected` naming the policy and the
step; the running set is untouched, so a bad module never replaces a working one, and
nothing of it is kept (its compiled code is cached only once it passed). Loads are
vetted one at a time (:data:`MAX_PENDING_LOADS` may wait; more are refused with
:class:`LoadsBusy`), so a burst of loads cannot take both cores from picks.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import anyio

from epick.interfaces import Capabilities, FailureKind, PolicyFailure
from epick.runtime import Limits, PolicyError, PolicyModule, Runtime, WasmPolicy, validate
from epick.runtime.runtime import trim_heap
from epick.scheduler.policyset import PolicyEntry, PolicySet, UnknownPolicyError
from epick.scheduler.scheduler import Scheduler

__all__ = [
    "PolicyManager", "PolicyRejected", "LoadsBusy", "ActivePolicy", "PolicySpec", "Origin",
    "read_module",
    "UnknownPolicyError", "check_name", "NAME_PATTERN", "MAX_PENDING_LOADS", "MAX_MODULE_BYTES",
]

log = logging.getLogger("epick.policies")

#: What a policy name may look like: the config's pattern (``PolicyConfig.name``).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_NAME = re.compile(NAME_PATTERN)
#: Hot loads waiting for the (single) vetting worker; one more is refused.
MAX_PENDING_LOADS = 4
#: Largest module that can go live: the runtime's cap (a bigger one is refused before it
#: is compiled), so the admin API need not receive more.
MAX_MODULE_BYTES = Limits().module_bytes


class PolicyRejected(PolicyFailure):
    """A module was refused; nothing changed. ``str()`` says which policy and why,
    ``kind`` (a :class:`FailureKind`) how it failed: the runtime's kind when a step of
    vetting failed, else the host's reason (``nonconformant``, ``bad-argument``…)."""

    def __init__(self, name: str, reason: str,
                 kind: FailureKind | str = FailureKind.INVALID_MODULE) -> None:
        super().__init__(f"policy {name!r} rejected: {reason}", kind=kind, policy=name)
        self.name = name
        self.reason = reason


class LoadsBusy(PolicyRejected):
    """Too many loads are already waiting to be vetted; try again later."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(name, reason, FailureKind.BUSY)


def check_name(name: str) -> None:
    """Raise PolicyRejected unless ``name`` matches :data:`NAME_PATTERN`."""
    if not isinstance(name, str) or not _NAME.match(name):
        shown = repr(name[:80]) + ("…" if len(name) > 80 else "") if isinstance(name, str) \
            else type(name).__name__
        raise PolicyRejected(
            "?" if not isinstance(name, str) else name[:80],
            f"name {shown} must match {NAME_PATTERN} (1-64 letters, digits, '.', '_', '-', "
            f"starting with a letter or digit)", FailureKind.BAD_ARGUMENT,
        )


#: How a live policy got there (``PolicyInfo.origin``): the config file, the admin API,
#: ``[admin] persist_dir`` at start, or the watched policy folder.
Origin = Literal["config", "admin", "saved", "policy_dir"]


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """One config entry, read: what :meth:`PolicyManager.replace_all` makes live."""

    name: str
    wasm: bytes = field(repr=False)
    params: dict = field(default_factory=dict)
    weight: float = 1.0
    shadow: bool = False
    source: str = "config"
    """The module file it was read from (for logs)."""


@dataclass(slots=True)
class ActivePolicy:
    """What the manager knows about a live policy beyond its plugin."""

    name: str
    module: PolicyModule
    params: dict
    source: str
    """Where it came from, for logs: a file path, ``admin`` or ``saved``."""
    origin: Origin = "config"
    version: str = ""
    kind: str = "custom"
    conformant: bool | None = None
    """Result of the conformance gate; ``None`` when it was not run (config-loaded)."""
    smoke_fuel: dict[str, int] = field(default_factory=dict)
    """Most fuel each request-path export used on the smoke run (``validate``)."""
    plugin: WasmPolicy | None = field(default=None, repr=False)
    """The live plugin, made off the event loop by :meth:`PolicyManager.prepare`; taken
    (set to None) by :meth:`PolicyManager.install`."""
    state_from: WasmPolicy | None = field(default=None, repr=False)
    """The plugin whose state ``plugin`` already holds (imported off the loop by
    :meth:`PolicyManager.activate_async`); :meth:`PolicyManager.install` hands over again
    only if another plugin is live by then."""


class PolicyManager:
    """Owns the runtime side of the scheduler's policy set.

    Runs on the scheduler's thread (the event loop): every method may call into WASM.
    """

    def __init__(
        self,
        runtime: Runtime,
        scheduler: Scheduler,
        *,
        require_conformance: bool = True,
        allow_nonconformant_shadow: bool = False,
    ) -> None:
        self.runtime = runtime
        self.scheduler = scheduler
        self.require_conformance = require_conformance
        self.allow_nonconformant_shadow = allow_nonconformant_shadow
        self.active: dict[str, ActivePolicy] = {}
        """The record of what is live, one per entry of ``scheduler.policies``; both are
        only ever assigned together, by :meth:`_commit`."""
        self.weight_overrides: dict[str, float] = {}
        """Weights set through the admin API; a reload keeps them unless the config
        entry of that policy changed."""
        self._vet_limiter: anyio.CapacityLimiter | None = None  # made on the event loop
        self._pending_loads = 0

    # -- loading -------------------------------------------------------------------

    def vet(
        self, name: str, wasm: bytes, params: dict | None, *, source: str, gate: bool,
        shadow: bool = False, origin: Origin = "config",
    ) -> ActivePolicy:
        """Compile, validate and (if ``gate``) conformance-check; raise PolicyRejected.

        Touches no live instance, so it may run on a worker thread: a conformance run
        takes ~0.1–0.3 s, which must not stall picks on the event loop.
        """
        check_name(name)
        params = dict(params or {})
        try:
            module = self.runtime.compile(wasm, name=name)
            smoke_fuel = validate(module, params)
            described = None
            if "describe" in module.exports:
                inst = module.for_vetting().instantiate(params)
                try:
                    described = inst.describe()
                finally:
                    inst.close()
        except PolicyError as exc:
            module = None  # drop the refused code before trimming the heap
            trim_heap()
            raise PolicyRejected(name, str(exc), exc.kind) from exc
        info = ActivePolicy(
            name=name, module=module, params=params, source=source, origin=origin,
            version=described.version if described else "",
            kind=described.kind if described else "custom", smoke_fuel=smoke_fuel,
        )
        if gate and self.require_conformance:
            self._gate(info, shadow)
        self.runtime.keep(module)  # accepted: only now is its compiled code cached
        return info

    def prepare(
        self, name: str, wasm: bytes, params: dict | None, *, source: str, gate: bool,
        shadow: bool = False, origin: Origin = "config",
    ) -> ActivePolicy:
        """:meth:`vet`, then make the live plugin (its ``init`` runs here too): all of
        the work that may take long, so it runs on a worker thread."""
        info = self.vet(name, wasm, params, source=source, gate=gate, shadow=shadow,
                        origin=origin)
        info.plugin = _make_plugin(info)
        return info

    def _gate(self, info: ActivePolicy, shadow: bool) -> None:
        from epick.conformance import ConformanceError, check  # only hot loads need it

        kind = info.kind if info.kind != "custom" else None
        try:
            # Fuel decides, not the wall clock: a busy machine must not fail a module.
            report = check(info.module.for_vetting(), info.params, kind=kind)
        except (ConformanceError, PolicyError) as exc:
            raise PolicyRejected(info.name, f"conformance could not run: {exc}",
                                 exc.kind) from exc
        info.conformant = report.passed
        if report.passed:
            return
        failed = report.failures
        summary = "; ".join(f"{c.name}: {c.why}" for c in failed[:3])
        if shadow and self.allow_nonconformant_shadow:
            log.warning("policy %r fails conformance; allowed in shadow only: %s",
                        info.name, summary)
            return
        raise PolicyRejected(info.name, f"fails conformance ({len(failed)} case(s)): {summary}",
                             FailureKind.NONCONFORMANT)

    def install(self, info: ActivePolicy, *, weight: float | None = None,
                shadow: bool = False) -> ActivePolicy:
        """Make a vetted module live (on the scheduler's thread): one :meth:`_commit`.

        It replaces the live policy of the same name in place (keeping its weight unless
        ``weight`` is given), else joins the set at the end."""
        name = info.name
        _check_weight(name, weight)
        current = self.scheduler.policies
        if weight is None:
            weight = current.get(name).weight if name in current else 1.0
        entry = self._entry(info, weight, shadow, current)
        live = [(e, self.active[e.name]) for e in current.entries if e.name != name]
        at = next((i for i, e in enumerate(current.entries) if e.name == name), len(live))
        live.insert(at, (entry, info))
        self._commit(live)
        log.info("policy %r live (%s, sha256 %s, weight %s%s)", name, info.source,
                 info.module.sha256[:12], entry.weight, ", shadow" if shadow else "")
        return info

    def _entry(self, info: ActivePolicy, weight: float, shadow: bool,
               current: PolicySet) -> PolicyEntry:
        """The live entry for a vetted ``info``: its plugin (made now if it was only
        vetted), given the state of the policy it replaces in ``current``."""
        plugin, info.plugin = info.plugin, None
        state_from, info.state_from = info.state_from, None
        if plugin is None:  # vetted, not prepared: make the instance here
            plugin = _make_plugin(info)
        if info.name in current and current.get(info.name).plugin is not state_from:
            self._hand_over(info.name, current.get(info.name).plugin, plugin)
        return PolicyEntry(name=info.name, plugin=plugin, weight=weight, shadow=shadow)

    def _commit(self, live: list[tuple[PolicyEntry, ActivePolicy]]) -> None:
        """The one way a set goes live: swap the scheduler's PolicySet and the record of
        what is live together, then free what left (plugins closed; a module no live
        policy uses is forgotten by the runtime)."""
        new_set = PolicySet(tuple(e for e, _ in live))  # refuses duplicates before any swap
        old_set, old_active = self.scheduler.policies, self.active
        self.scheduler.policies = new_set
        self.active = {info.name: info for _, info in live}
        kept = {id(e.plugin) for e, _ in live}
        for entry in old_set.entries:
            if id(entry.plugin) not in kept:
                self._release(entry.plugin, old_active.get(entry.name))

    @property
    def runtime_loaded(self) -> set[str]:
        """Policies made live while serving (admin API, policy folder, saved), not by the
        config: a config reload keeps them (see :meth:`replace_all`)."""
        return {n for n, info in self.active.items() if info.origin != "config"}

    def activate(
        self,
        name: str,
        wasm: bytes,
        params: dict | None = None,
        *,
        weight: float | None = None,
        shadow: bool = False,
        source: str = "admin",
        gate: bool = True,
    ) -> ActivePolicy:
        """Vet and install in one go, on the calling (scheduler) thread."""
        _check_weight(name, weight)
        info = self.vet(name, wasm, params, source=source, gate=gate, shadow=shadow,
                        origin=_origin_of(source))
        return self.install(info, weight=weight, shadow=shadow)

    async def activate_async(self, name: str, wasm: bytes, params: dict | None = None, *,
                             weight: float | None = None, shadow: bool = False,
                             source: str = "admin", gate: bool = True) -> ActivePolicy:
        """Like :meth:`activate`, vetting and instantiating on a worker thread so picks
        keep flowing. Raises :class:`LoadsBusy` when :data:`MAX_PENDING_LOADS` loads
        already wait."""
        check_name(name)
        _check_weight(name, weight)
        info = await self.run_vetting(name, functools.partial(
            self.prepare, name, wasm, params, source=source, gate=gate, shadow=shadow,
            origin=_origin_of(source)))
        try:
            await self._hand_over_off_loop(info)
        except BaseException:  # cancelled: the prepared plugin never goes live
            info.plugin.close()
            raise
        return self.install(info, weight=weight, shadow=shadow)

    async def _hand_over_off_loop(self, info: ActivePolicy) -> None:
        """Give the prepared ``info.plugin`` the state of the live policy it replaces:
        exported here, on the loop (the live Store is the loop's; ~1-9 ms for a prefix
        cache of 2-8 MiB), imported on a worker thread (the new plugin is not live yet;
        the import is the dearer half: ~8-28 ms). Hooks the live policy runs between the
        export and the swap are not carried over, as with any checkpoint."""
        current = self.scheduler.policies
        if info.name not in current:
            return
        old = current.get(info.name).plugin
        if Capabilities.STATE not in old.capabilities & info.plugin.capabilities:
            return
        state = _export(info.name, old)
        if state:
            await anyio.to_thread.run_sync(_import, info.name, info.plugin, state)
        info.state_from = old

    async def run_vetting(self, name: str, fn):
        """``fn()`` on the vetting worker thread, one at a time, a few waiting at most
        (:class:`LoadsBusy` naming ``name`` beyond that)."""
        if self._pending_loads >= MAX_PENDING_LOADS + 1:
            raise LoadsBusy(
                name, f"{self._pending_loads} loads are already being vetted or waiting "
                f"(at most {MAX_PENDING_LOADS + 1}); try again when one has finished")
        if self._vet_limiter is None:
            self._vet_limiter = anyio.CapacityLimiter(1)
        self._pending_loads += 1
        try:
            return await anyio.to_thread.run_sync(fn, limiter=self._vet_limiter)
        finally:
            self._pending_loads -= 1

    @staticmethod
    def _hand_over(name: str, old: WasmPolicy, new: WasmPolicy) -> None:
        """Carry state (LoRA history, prefix LRU) across a swap when both sides can."""
        if Capabilities.STATE not in old.capabilities & new.capabilities:
            return
        state = _export(name, old)
        if state:
            _import(name, new, state)

    def remove(self, name: str) -> None:
        """Take ``name`` out of the live set and free it (instance closed, code dropped)."""
        current = self.scheduler.policies
        current.get(name)  # UnknownPolicyError naming it
        self._commit([(e, self.active[e.name]) for e in current.entries if e.name != name])
        self.weight_overrides.pop(name, None)
        log.info("policy %r removed", name)

    def _release(self, plugin: WasmPolicy, info: ActivePolicy | None) -> None:
        """Close a plugin that left the live set; forget its module if none uses it."""
        plugin.close()
        if info is not None:
            sha = info.module.sha256
            if all(a.module.sha256 != sha for a in self.active.values()):
                self.runtime.forget(sha)

    def set_weight(self, name: str, weight: float) -> PolicyEntry:
        _check_weight(name, weight)
        self.scheduler.policies = self.scheduler.policies.with_weight(name, weight)
        self.weight_overrides[name] = weight
        return self.scheduler.policies.get(name)

    def replace_all(self, entries: list[PolicySpec], *,
                    changed: frozenset[str] | set[str] | None = None) -> list[str]:
        """Make the config's policies live (config load/reload), all or nothing; return
        the names of the policies kept that the config does not decide.

        Policies whose module bytes and params did not change keep their instance (and
        state); the others are prepared first, so any rejection leaves everything as is.
        Nothing loaded while serving is lost: a policy loaded through the admin API or
        the policy folder stays — beside the config's, or in place of a config entry of
        the same name while that entry is unchanged (``changed`` names the entries that
        differ from the last applied config; ``None``: all of them). Admin weights stay
        likewise. A changed entry wins, and that is logged as a warning.
        """
        return self.apply_all(entries, self.prepare_all(entries, changed), changed)

    async def replace_all_async(self, entries: list[PolicySpec],
                                *, changed: frozenset[str] | set[str] | None = None
                                ) -> list[str]:
        """:meth:`replace_all` with the compiles and vetting on the vetting worker, and
        state handed over as :meth:`activate_async` does (imported off the loop)."""
        fresh = await self.run_vetting(
            "config", functools.partial(self.prepare_all, entries, changed))
        try:
            for info in fresh.values():
                await self._hand_over_off_loop(info)
        except BaseException:  # cancelled: none of them goes live
            for info in fresh.values():
                info.plugin.close()
            raise
        return self.apply_all(entries, fresh, changed)

    def _unchanged(self, name: str, wasm: bytes, params: dict) -> bool:
        info = self.active.get(name)
        return (info is not None and name in self.scheduler.policies
                and info.module.sha256 == _sha256(wasm) and info.params == params)

    def _kept_at_runtime(self, name: str, changed: frozenset[str]) -> bool:
        """A policy loaded while serving stays in place of its unchanged config entry."""
        info = self.active.get(name)
        return (info is not None and info.origin != "config"
                and name in self.scheduler.policies and name not in changed)

    @staticmethod
    def _changed(entries, changed) -> frozenset[str]:
        return frozenset(e.name for e in entries) if changed is None else frozenset(changed)

    def prepare_all(self, entries, changed=None) -> dict[str, ActivePolicy]:
        """The changed entries, each :meth:`prepare`-d (may run on a worker thread: it
        only reads ``active``). On a rejection, what was prepared is closed."""
        changed = self._changed(entries, changed)
        fresh: dict[str, ActivePolicy] = {}
        try:
            for spec in entries:
                if self._kept_at_runtime(spec.name, changed):
                    continue
                if not self._unchanged(spec.name, spec.wasm, spec.params):
                    fresh[spec.name] = self.prepare(spec.name, spec.wasm, spec.params,
                                                    source=spec.source, gate=False)
        except BaseException:
            for info in fresh.values():
                if info.plugin is not None:
                    info.plugin.close()
            raise
        return fresh

    def apply_all(self, entries: list[PolicySpec], fresh: dict[str, ActivePolicy],
                  changed=None) -> list[str]:
        """On the scheduler's thread: swap in ``entries`` (``fresh`` from prepare_all);
        return the names of the policies kept that the config does not decide."""
        current = self.scheduler.policies
        changed = self._changed(entries, changed)
        config_names = {e.name for e in entries}
        for spec in entries:  # all checked before any plugin is taken
            if (spec.name not in fresh and not self._kept_at_runtime(spec.name, changed)
                    and not self._unchanged(spec.name, spec.wasm, spec.params)):
                for other in fresh.values():  # changed while we vetted
                    if other.plugin is not None:
                        other.plugin.close()
                raise PolicyRejected(spec.name, "the live set changed during the reload; "
                                     "reload again", FailureKind.CONFLICT)
        live: list[tuple[PolicyEntry, ActivePolicy]] = []
        for spec in entries:
            name, weight = spec.name, spec.weight
            info = self.active.get(name) if name in current else None
            if info is not None and info.origin != "config":
                if name not in changed:
                    live.append((current.get(name), info))
                    continue
                log.warning("policy %r: its config entry changed, so the config's module "
                            "replaces the one loaded at run time (%s)", name, info.source)
            if name not in changed and name in self.weight_overrides and name in current:
                weight = current.get(name).weight
            if name in fresh:
                live.append((self._entry(fresh[name], weight, spec.shadow, current),
                             fresh[name]))
                continue
            live.append((PolicyEntry(name, current.get(name).plugin, weight, spec.shadow),
                         self.active[name]))
        live += [(e, self.active[e.name]) for e in current.entries
                 if e.name not in config_names and self.active[e.name].origin != "config"]
        self._commit(live)
        self.weight_overrides = {n: w for n, w in self.weight_overrides.items()
                                 if n in self.active and n not in changed}
        return [info.name for _, info in live if info.origin != "config"]

    def get(self, name: str) -> tuple[PolicyEntry, ActivePolicy]:
        entry = self.scheduler.policies.get(name)
        return entry, self.active[name]

    def checkpoint_all(self) -> None:
        """Capture each policy's last good state if due (plugins are made with
        checkpoint_on_hooks=False, so this is the only place it happens)."""
        for entry in self.scheduler.policies.entries:
            entry.plugin.checkpoint()  # every live plugin is a WasmPolicy made here

    async def checkpoint_each(self) -> None:
        """:meth:`checkpoint_all` one policy per turn of the event loop, so picks run
        between two policies' exports. The export stays on the loop: the live Store is
        used by picks there, and copying its memory out to export elsewhere costs more
        than the export (a 32-endpoint prefix cache: 28 MiB copied in ~16 ms against
        ~6-9 ms to export its 7.6 MiB of state); each plugin already spaces its exports
        so they take <= 0.2% of the time."""
        for entry in self.scheduler.policies.entries:
            if any(e.plugin is entry.plugin for e in self.scheduler.policies.entries):
                entry.plugin.checkpoint()  # still live: not swapped out meanwhile
            await anyio.sleep(0)

    def names(self) -> list[str]:
        return [e.name for e in self.scheduler.policies.entries]


def _origin_of(source: str) -> Origin:
    """The origin of a policy made live while serving, from its ``source``."""
    return source if source in ("admin", "saved") else "policy_dir"


def _export(name: str, plugin: WasmPolicy) -> bytes | None:
    try:
        return plugin.export_state()
    except PolicyError as exc:
        # The new module starts fresh; losing warm state costs quality, not safety.
        log.warning("policy %r: state not handed over: %s", name, exc)
        return None


def _import(name: str, plugin: WasmPolicy, state: bytes) -> None:
    try:
        plugin.import_state(state)
    except PolicyError as exc:
        log.warning("policy %r: state not handed over: %s", name, exc)


def _make_plugin(info: ActivePolicy) -> WasmPolicy:
    try:
        return WasmPolicy(info.module, info.params, name=info.name,
                          checkpoint_on_hooks=False, background_recovery=True)
    except PolicyError as exc:
        raise PolicyRejected(info.name, str(exc), exc.kind) from exc


def _check_weight(name: str, weight: float | None) -> None:
    if weight is not None and not (weight >= 0 and math.isfinite(weight)):
        raise PolicyRejected(name, f"weight must be a finite number >= 0, got {weight}",
                             FailureKind.BAD_ARGUMENT)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


#: Largest module file read (the runtime refuses bigger modules anyway).
MAX_FILE_BYTES = 32 << 20


def read_module(path: Path, *, inside: Path | None = None, max_bytes: int = MAX_FILE_BYTES
                ) -> bytes:
    """The bytes of the module file ``path``, read safely (it may be dropped by anyone
    who can write to a watched folder).

    Only a regular file is read: a FIFO, a device or a directory is refused without
    blocking (opened with ``O_NONBLOCK``, checked with ``fstat`` on the open file, so it
    cannot be swapped in between). With ``inside``, the file must be in that folder and
    not a symlink (``O_NOFOLLOW``), so a link cannot point the watcher at a file
    elsewhere. Files over ``max_bytes`` are refused before they are read. Raises
    :class:`PolicyRejected` (``unreadable``) naming the file.
    """
    name = path.stem
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if inside is not None:
        flags |= getattr(os, "O_NOFOLLOW", 0)
        folder = Path(inside).resolve()
        if Path(os.path.realpath(path.parent)) != folder:
            raise _unreadable(name, f"{path} is not directly in {folder}")
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if inside is not None and path.is_symlink():
            raise _unreadable(name, f"{path} is a symlink; only regular files are "
                                 "loaded from the policy folder") from None
        raise _unreadable(name, f"cannot read {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _unreadable(name, f"{path} is not a regular file "
                                 f"({_file_kind(st.st_mode)}); not read")
        if st.st_size > max_bytes:
            raise _unreadable(name, f"{path} is {st.st_size:,} bytes, over the "
                                 f"{max_bytes:,}-byte cap; not read")
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise _unreadable(name, f"cannot read {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:  # grew while we read
        raise _unreadable(name, f"{path} is over the {max_bytes:,}-byte cap; not read")
    return data


def _unreadable(name: str, reason: str) -> PolicyRejected:
    return PolicyRejected(name, reason, FailureKind.UNREADABLE)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"

