"""The live set of policies: an immutable value, swapped atomically as a whole.

A pick reads ``scheduler.policies`` once and uses that set to the end, so a hot swap
never changes the rules in the middle of a decision: in-flight requests finish on the
old set, the next one sees the new set. Changes build a new :class:`PolicySet`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from epick.interfaces import Capabilities, Plugin, check_plugin

__all__ = ["PolicyEntry", "PolicySet", "DuplicatePolicyError", "UnknownPolicyError"]


class DuplicatePolicyError(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"a policy named {name!r} already exists")
        self.name = name


class UnknownPolicyError(KeyError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"no policy named {self.name!r}"


@dataclass(frozen=True, slots=True)
class PolicyEntry:
    """One policy in a set. Making one is installing its plugin: the plugin's declared
    :class:`~epick.interfaces.Capabilities` are checked here, once
    (:class:`~epick.interfaces.PluginSpecError` naming it if it implements nothing or
    lacks a method it declares), and every stage reads ``capabilities`` afterwards."""

    name: str
    plugin: Plugin
    weight: float = 1.0
    shadow: bool = False
    capabilities: Capabilities = field(init=False, default=Capabilities.NONE)
    scores_in_range: bool = field(init=False, default=False)
    """SCORES_IN_RANGE is declared: the scheduler need not clamp (read on every pick; a
    flag test costs ~0.8 µs, this attribute nothing)."""

    def __post_init__(self) -> None:
        caps = check_plugin(self.name, self.plugin)
        object.__setattr__(self, "capabilities", caps)
        object.__setattr__(self, "scores_in_range", Capabilities.SCORES_IN_RANGE in caps)

    @property
    def is_filter(self) -> bool:
        return Capabilities.FILTER in self.capabilities

    @property
    def is_scorer(self) -> bool:
        return Capabilities.SCORE in self.capabilities

    @property
    def has_pre_request(self) -> bool:
        return Capabilities.PRE_REQUEST in self.capabilities

    @property
    def has_post_response(self) -> bool:
        return Capabilities.POST_RESPONSE in self.capabilities


@dataclass(frozen=True, slots=True)
class PolicySet:
    """Ordered policies plus the per-extension-point lists a pick iterates (precomputed)."""

    entries: tuple[PolicyEntry, ...] = ()

    # Precomputed views; filled in __post_init__.
    filters: tuple[PolicyEntry, ...] = ()
    scorers: tuple[PolicyEntry, ...] = ()
    shadows: tuple[PolicyEntry, ...] = ()
    pre_request: tuple[PolicyEntry, ...] = ()
    post_response: tuple[PolicyEntry, ...] = ()
    score_group: Callable | None = None
    """The scorers' ``score_group`` when every live scorer has the same one (WASM policies:
    one native call for all; epick.interfaces.plugins), else ``None``."""
    pre_request_group: Callable | None = None
    """The same for the ``pre_request`` entries (``pre_request_group``: WASM policies, one
    Python call for all), else ``None``."""

    def __post_init__(self) -> None:
        names = [e.name for e in self.entries]
        for name in names:
            if names.count(name) > 1:
                raise DuplicatePolicyError(name)
        live = [e for e in self.entries if not e.shadow]
        set_ = object.__setattr__
        set_(self, "filters", tuple(e for e in live if e.is_filter))
        set_(self, "scorers", tuple(e for e in live if e.is_scorer))
        set_(self, "shadows", tuple(e for e in self.entries if e.shadow and e.is_scorer))
        # Shadow policies record decisions too, so their state tracks the live traffic.
        set_(self, "pre_request", tuple(e for e in self.entries if e.has_pre_request))
        set_(self, "post_response", tuple(e for e in self.entries if e.has_post_response))
        groups = {getattr(e.plugin, "score_group", None) for e in self.scorers}
        set_(self, "score_group", groups.pop() if len(groups) == 1 else None)
        groups = {getattr(e.plugin, "pre_request_group", None) for e in self.pre_request}
        set_(self, "pre_request_group", groups.pop() if len(groups) == 1 else None)

    @classmethod
    def of(cls, *entries: PolicyEntry) -> PolicySet:
        return cls(entries=tuple(entries))

    def get(self, name: str) -> PolicyEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise UnknownPolicyError(name)

    def __contains__(self, name: object) -> bool:
        return any(e.name == name for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, entry: PolicyEntry) -> PolicySet:
        """A set with ``entry`` added, or replacing the entry of the same name in place."""
        if entry.name in self:
            return PolicySet(tuple(entry if e.name == entry.name else e for e in self.entries))
        return PolicySet(self.entries + (entry,))

    def remove(self, name: str) -> PolicySet:
        self.get(name)
        return PolicySet(tuple(e for e in self.entries if e.name != name))

    def with_weight(self, name: str, weight: float) -> PolicySet:
        return self.put(replace(self.get(name), weight=weight))
