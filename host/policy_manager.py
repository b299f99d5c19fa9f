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

import logging
from dataclasses import dataclass, field
from pathlib import Path

from epick.runtime import PolicyError, PolicyModule, Runtime, WasmPolicy, validate
from epick.scheduler.policyset import PolicyEntry, PolicySet, UnknownPolicyError
from epick.scheduler.scheduler import Scheduler

__all__ = ["PolicyManager", "PolicyRejected", "ActivePolicy"]

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
    extra: dict = field(default_factory=dict)


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

    # -- loading -------------------------------------------------------------------

    def prepare(
        self, name: str, wasm: bytes, params: dict | None, *, source: str, gate: bool,
        shadow: bool = False,
    ) -> tuple[WasmPolicy, ActivePolicy]:
        """Compile, validate and (if ``gate``) conformance-check; raise PolicyRejected."""
        params = dict(params or {})
        try:
            module = self.runtime.compile(wasm, name=name)
            validate(module, params)
            plugin = WasmPolicy(module, params, name=name)
            described = plugin.describe() if "describe" in module.exports else None
        except PolicyError as exc:
            raise PolicyRejected(name, str(exc)) from exc
        info = ActivePolicy(
            name=name, module=module, params=params, source=source,
            version=described.version if described else "",
            kind=described.kind if described else "custom",
        )
        if gate and self.require_conformance:
            report = self._conformance(module, params, info.kind)
            info.conformant = report.passed
            if not report.passed:
                failed = [c for c in report.cases if c.verdict != "pass"]
                summary = "; ".join(f"{c.name}: {c.why}" for c in failed[:3])
                if not (shadow and self.allow_nonconformant_shadow):
                    raise PolicyRejected(
                        name, f"fails conformance ({len(failed)} case(s)): {summary}"
                    )
                log.warning("policy %r fails conformance; allowed in shadow only: %s",
                            name, summary)
        return plugin, info

    @staticmethod
    def _conformance(module: PolicyModule, params: dict, kind: str):
        from epick.conformance import check  # imported late: only hot loads need it

        return check(module, params, kind=kind if kind != "custom" else None)

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
        """Make ``wasm`` live as policy ``name`` (new, or replacing the one of that name)."""
        if weight is not None and not weight >= 0:
            raise PolicyRejected(name, f"weight must be >= 0, got {weight}")
        plugin, info = self.prepare(name, wasm, params, source=source, gate=gate,
                                    shadow=shadow)
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
        log.info("policy %r live (%s, sha256 %s, weight %s%s)", name, source,
                 info.module.sha256[:12], entry.weight, ", shadow" if shadow else "")
        return info

    @staticmethod
    def _hand_over(name: str, old: object, new: WasmPolicy) -> None:
        """Carry state (LoRA history, prefix LRU) across a swap when both sides can."""
        export = getattr(old, "export_state", None)
        if export is None or not getattr(old, "has_state", True) or not new.has_state:
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
        log.info("policy %r removed", name)

    def set_weight(self, name: str, weight: float) -> PolicyEntry:
        if not weight >= 0:
            raise PolicyRejected(name, f"weight must be >= 0, got {weight}")
        self.scheduler.policies = self.scheduler.policies.with_weight(name, weight)
        return self.scheduler.policies.get(name)

    def replace_all(self, entries: list[tuple[str, bytes, dict, float, bool, str]]) -> None:
        """Make exactly these policies live (config load/reload), all or nothing.

        Policies whose module bytes and params did not change keep their instance (and
        state); the others are prepared first, so any rejection leaves everything as is.
        """
        current = self.scheduler.policies
        prepared: list[tuple[PolicyEntry, ActivePolicy]] = []
        for name, wasm, params, weight, shadow, source in entries:
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
            plugin, info = self.prepare(name, wasm, params, source=source, gate=False)
            if name in current:
                self._hand_over(name, current.get(name).plugin, plugin)
            prepared.append((PolicyEntry(name, plugin, weight, shadow), info))
        self.scheduler.policies = PolicySet(tuple(e for e, _ in prepared))
        self.active = {info.name: info for _, info in prepared}

    def get(self, name: str) -> tuple[PolicyEntry, ActivePolicy]:
        entry = self.scheduler.policies.get(name)
        return entry, self.active[name]

    def names(self) -> list[str]:
        return [e.name for e in self.scheduler.policies.entries]


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def read_module(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise PolicyRejected(path.stem, f"cannot read {path}: {exc.strerror}") from None


__all__ += ["read_module", "UnknownPolicyError"]
