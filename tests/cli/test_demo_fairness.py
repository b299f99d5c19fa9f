"""`epick demo` leaves no replica unused (issue 30): with affinity concentrating work, the
replica with the fewest picks still gets at least a quarter of the mean. Seed 1 is the
seed where, before the work-conserving rule and load's counts of what epick sent, one
replica got no pick in 30 s although it was a candidate in every decision."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_demos_least_picked_replica_gets_a_quarter_of_the_mean():
    done = subprocess.run(
        [sys.executable, "-m", "epick.cli", "demo", "--duration", "30", "--seed", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.search(r"picks per replica\s*│\s*([\d ]+?)\s*│", done.stdout)
    assert found, done.stdout
    picks = [int(n) for n in found.group(1).split()]
    assert len(picks) == 6, picks  # the demo's six replicas
    mean = sum(picks) / len(picks)
    assert mean > 0, picks
    assert min(picks) >= 0.25 * mean, f"picks per replica {picks}: min below a quarter of the mean"
