"""What a replay reports: agreement, score deltas, the most changed decisions."""

from __future__ import annotations

import msgspec

__all__ = ["ReplayReport", "PolicyDelta", "ChangedDecision", "SCORE_EPSILON"]

#: Scores closer than this are "the same" (the log keeps scores as f32).
SCORE_EPSILON = 1e-6


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
