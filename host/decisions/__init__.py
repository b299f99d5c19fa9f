"""The decision log: record every pick, replay it offline through changed policies.

    DecisionLog   (writer.py)  the scheduler's sink: a bounded queue, a writer thread,
                               rotated files
    schema        (schema.py)  the records, version 1 (policies/DECISIONS.md)
    read          (reader.py)  the records back, file by file
    Replayer      (replay/)    recorded decisions through the real scheduler and runtime
                               (report, locality, stand-ins, modules, the replayer)
    trace         (trace.py)   a log as a workload for the simulated fleet
"""

from epick.decisions.reader import LogError, log_files, read, read_file
from epick.decisions.replay import Changes, Replayer, ReplayError, ReplayReport, replay
from epick.decisions.writer import DecisionLog, segments

__all__ = [
    "DecisionLog",
    "segments",
    "LogError",
    "log_files",
    "read",
    "read_file",
    "Changes",
    "Replayer",
    "ReplayError",
    "ReplayReport",
    "replay",
]
