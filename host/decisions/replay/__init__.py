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

Modules, one job each: ``changes`` (:class:`Changes`, :class:`ReplayError`), ``report``
(:class:`ReplayReport` and its parts), ``locality`` (prefix and adapter locality of a
stream of picks), ``standins`` (policies as they failed or recovered live, the recorded
assignment and KV counts given to each ``schedule`` call), ``modules`` (wasm lookup and
compilation), ``replayer`` (:class:`Replayer`, :func:`replay`).
"""

from epick.decisions.replay.changes import Changes, ReplayError
from epick.decisions.replay.replayer import Replayer, replay
from epick.decisions.replay.report import ChangedDecision, PolicyDelta, ReplayReport

__all__ = ["Changes", "Replayer", "ReplayError", "ReplayReport", "PolicyDelta",
           "ChangedDecision", "replay"]
