"""A SIGTERM to a process holding a fleet stops the replicas (no vLLM: start/stop stubbed).

Found when ``kill PID`` of a running ``epick bench real`` left both vLLM replicas running
in their own sessions: Python's default SIGTERM skips ``__exit__``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from epick.fleet.fleet import VllmFleet

CHILD = textwrap.dedent("""
    import sys, time
    from epick.fleet.fleet import VllmFleet

    class Stub(VllmFleet):
        def start(self, timeout_s=300.0):
            return []
        def stop(self):
            with open(sys.argv[1], "w") as f:
                f.write("stopped")

    with Stub(1):
        print("up", flush=True)
        time.sleep(60)
""")


def test_sigterm_stops_the_replicas(tmp_path):
    marker = tmp_path / "stopped"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(marker)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        child.kill()
    assert marker.read_text() == "stopped"


class Stub(VllmFleet):
    """A fleet that starts and stops nothing: only the signal handling is under test."""

    def start(self, timeout_s=300.0):
        return []

    def stop(self):
        pass


def test_a_handler_the_program_set_is_kept():
    def mine(*_):
        pass

    old = signal.signal(signal.SIGTERM, mine)
    try:
        with Stub(1):
            assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)


def test_the_default_is_restored_after_the_fleet():
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with Stub(1):
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, old)
