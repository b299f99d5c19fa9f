"""Turning modules into live policies, and swapping them while serving.

Every way a policy goes live — the config file at start or reload, the watched policy
directory, the admin API — goes through :meth:`PolicyManager.activate`:

    compile (cached by content hash) -> validate (exports, ABI, init, smoke run)
      -> conformance gate (hot loads only; shadow may be exempt by config)
      -> hand state over from the policy it replaces (export_state -> import_state)
      -> one assignment of a new PolicySet to the scheduler

A module that fails any step raises :class:`PolicyRejected` naming the policy and the
step; the running set is untouched, so a bad module never replaces a working one.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import anyio

from epick.runtime import PolicyError, PolicyModule, Runtime, WasmPolicy, validate
from epick.scheduler.policyset import PolicyEntry, PolicySet, UnknownPolicyError
from epick.scheduler.scheduler import Scheduler

__all__ = ["PolicyManager", "PolicyRejected", "ActivePolicy", "read_module", "UnknownPolicyError"]

log = logging.getLogger("epick.policies")


class PolicyRejected(Exception):
    """A module was refused; nothing changed. ``str()`` says which policy and why."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"policy {name!r} rejected: {reason}")
        self.name = name
        self.reason = reason


@dataclass(slots=True)
class ActivePolicy:
    """What the manager knows about a live policy beyond its plugin."""

    name: str
    module: PolicyModule
    params: dict
    source: str
    """Where it came from: a file path, ``admin`` or ``config``."""
    version: str = ""
    kind: str = "custom"
    conformant: bool | None = None
    """Result of the conformance gate; ``None`` when it was not run (config-loaded)."""
    shadow_calls: int = 0
    shadow_agree: int = 0


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
        self.runtime_loaded: set[str] = set()
        """Policies made live while serving (admin API, policy folder), not by the config:
        a config reload keeps them (see :meth:`replace_all`)."""
        self.weight_overrides: dict[str, float] = {}
        """Weights set through the admin API; a reload keeps them unless the config
        entry of that policy changed."""

    # -- loading -------------------------------------------------------------------

    def vet(
        self, name: str, wasm: bytes, params: dict | None, *, source: str, gate: bool,
        shadow: bool = False,
    ) -> ActivePolicy:
        """Compile, validate and (if ``gate``) conformance-check; raise PolicyRejected.

        Touches no live instance, so it may run on a worker thread: a conformance run
        takes ~0.1–0.3 s, which must not stall picks on the event loop.
        """
        params = dict(params or {})
        try:
            module = self.runtime.compile(wasm, name=name)
            validate(module, params)
            described = None
            if "describe" in module.exports:
                inst = module.instantiate(params)
                try:
                    described = inst.describe()
                finally:
                    inst.close()
        except PolicyError as exc:
            raise PolicyRejected(name, str(exc)) from exc
        info = ActivePolicy(
            name=name, module=module, params=params, source=source,
            version=described.version if described else "",
            kind=described.kind if described else "custom",
        )
        if gate and self.require_conformance:
            self._gate(info, shadow)
        return info

    def _gate(self, info: ActivePolicy, shadow: bool) -> None:
        from epick.conformance import ConformanceError, check  # only hot loads need it

        kind = info.kind if info.kind != "custom" else None
        try:
            report = check(info.module, info.params, kind=kind)
        except (ConformanceError, PolicyError) as exc:
            raise PolicyRejected(info.name, f"conformance could not run: {exc}") from exc
        info.conformant = report.passed
        if report.passed:
            return
        failed = report.failures
        summary = "; ".join(f"{c.name}: {c.why}" for c in failed[:3])
        if shadow and self.allow_nonconformant_shadow:
            log.warning("policy %r fails conformance; allowed in shadow only: %s",
                        info.name, summary)
            return
        raise PolicyRejected(info.name, f"fails conformance ({len(failed)} case(s)): {summary}")

    def install(self, info: ActivePolicy, *, weight: float | None = None,
                shadow: bool = False) -> ActivePolicy:
        """Make a vetted module live (on the scheduler's thread): one PolicySet swap."""
        name = info.name
        _check_weight(name, weight)
        try:
            plugin = WasmPolicy(info.module, info.params, name=name,
                                    checkpoint_on_hooks=False)
        except PolicyError as exc:
            raise PolicyRejected(name, str(exc)) from exc
        current = self.scheduler.policies
        old = current.get(name) if name in current else None
        if old is not None:
            self._hand_over(name, old.plugin, plugin)
            if weight is None:
                weight = old.weight
        entry = PolicyEntry(name=name, plugin=plugin, weight=1.0 if weight is None else weight,
                            shadow=shadow)
        self.scheduler.policies = current.put(entry)
        self.active[name] = info
        self.runtime_loaded.add(name)
        log.info("policy %r live (%s, sha256 %s, weight %s%s)", name, info.source,
                 info.module.sha256[:12], entry.weight, ", shadow" if shadow else "")
        return info

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
        info = self.vet(name, wasm, params, source=source, gate=gate, shadow=shadow)
        return self.install(info, weight=weight, shadow=shadow)

    async def activate_async(self, name: str, wasm: bytes, params: dict | None = None, *,
                             weight: float | None = None, shadow: bool = False,
                             source: str = "admin", gate: bool = True) -> ActivePolicy:
        """Like :meth:`activate`, vetting on a worker thread so picks keep flowing."""
        _check_weight(name, weight)
        info = await anyio.to_thread.run_sync(
            functools.partial(self.vet, name, wasm, params, source=source, gate=gate,
                              shadow=shadow))
        return self.install(info, weight=weight, shadow=shadow)

    @staticmethod
    def _hand_over(name: str, old: object, new: WasmPolicy) -> None:
        """Carry state (LoRA history, prefix LRU) across a swap when both sides can."""
        export = getattr(old, "export_state", None)
        if export is None or not getattr(old, "has_state", False) or not new.has_state:
            return
        try:
            state = export()
            if state:
                new.import_state(state)
        except PolicyError as exc:
            # The new module starts fresh; losing warm state costs quality, not safety.
            log.warning("policy %r: state not handed over: %s", name, exc)

    def remove(self, name: str) -> None:
        self.scheduler.policies = self.scheduler.policies.remove(name)
        self.active.pop(name, None)
        self.runtime_loaded.discard(name)
        self.weight_overrides.pop(name, None)
        log.info("policy %r removed", name)

    def set_weight(self, name: str, weight: float) -> PolicyEntry:
        _check_weight(name, weight)
        self.scheduler.policies = self.scheduler.policies.with_weight(name, weight)
        self.weight_overrides[name] = weight
        return self.scheduler.policies.get(name)

    def replace_all(self, entries: list[tuple[str, bytes, dict, float, bool, str]], *,
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
        current = self.scheduler.policies
        changed = frozenset(e[0] for e in entries) if changed is None else frozenset(changed)
        config_names = {e[0] for e in entries}
        prepared: list[tuple[PolicyEntry, ActivePolicy]] = []
        for name, wasm, params, weight, shadow, source in entries:
            if name in self.runtime_loaded and name in current and name in self.active:
                if name not in changed:
                    prepared.append((current.get(name), self.active[name]))
                    continue
                log.warning("policy %r: its config entry changed, so the config's module "
                            "replaces the one loaded at run time (%s)", name,
                            self.active[name].source)
            if name not in changed and name in self.weight_overrides and name in current:
                weight = current.get(name).weight
            info = self.active.get(name)
            if (
                info is not None
                and name in current
                and info.module.sha256 == _sha256(wasm)
                and info.params == params
            ):
                prepared.append((PolicyEntry(name, current.get(name).plugin, weight, shadow),
                                 info))
                continue
            info = self.vet(name, wasm, params, source=source, gate=False)
            try:
                plugin = WasmPolicy(info.module, info.params, name=name,
                                    checkpoint_on_hooks=False)
            except PolicyError as exc:
                raise PolicyRejected(name, str(exc)) from exc
            if name in current:
                self._hand_over(name, current.get(name).plugin, plugin)
            prepared.append((PolicyEntry(name, plugin, weight, shadow), info))
        kept = [e.name for e in current.entries
                if e.name in self.runtime_loaded and e.name not in config_names
                and e.name in self.active]
        prepared += [(current.get(name), self.active[name]) for name in kept]
        self.scheduler.policies = PolicySet(tuple(e for e, _ in prepared))
        self.active = {info.name: info for _, info in prepared}
        live = {info.name for _, info in prepared}
        self.runtime_loaded &= {n for n in live if n not in changed or n not in config_names}
        self.weight_overrides = {n: w for n, w in self.weight_overrides.items()
                                 if n in live and n not in changed}
        return [info.name for _, info in prepared if info.name in self.runtime_loaded]

    def get(self, name: str) -> tuple[PolicyEntry, ActivePolicy]:
        entry = self.scheduler.policies.get(name)
        return entry, self.active[name]

    def checkpoint_all(self) -> None:
        """Capture each policy's last good state if due (the service calls this once a
        second, off the request path: plugins are made with checkpoint_on_hooks=False)."""
        for entry in self.scheduler.policies.entries:
            checkpoint = getattr(entry.plugin, "checkpoint", None)
            if checkpoint is not None:
                checkpoint()

    def names(self) -> list[str]:
        return [e.name for e in self.scheduler.policies.entries]


def _check_weight(name: str, weight: float | None) -> None:
    if weight is not None and not (weight >= 0 and math.isfinite(weight)):
        raise PolicyRejected(name, f"weight must be a finite number >= 0, got {weight}")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_module(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise PolicyRejected(path.stem, f"cannot read {path}: {exc.strerror}") from None

