"""`epick demo` stopped by SIGTERM while it serves: it prints its summary of what ran,
stops its children, exits 143, and leaves no aiohttp session or connector unclosed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ok_picks(metrics_url: str) -> float:
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith('epick_picks_total{outcome="ok"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_sigterm_while_serving_prints_the_summary_and_no_unclosed_warning(tmp_path):
    stderr = (tmp_path / "stderr").open("w+")
    demo = subprocess.Popen(
        [sys.executable, "-X", "dev", "-m", "epick.cli", "demo", "--duration", "60",
         "--rate", "4", "--replicas", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        out: list[str] = []
        metrics_url = None
        deadline = time.monotonic() + 90
        while metrics_url is None and time.monotonic() < deadline:
            line = demo.stdout.readline()
            assert line, "the demo ended before printing its addresses"
            out.append(line)
            if line.startswith("epick metrics"):
                metrics_url = line.split()[2]
        assert metrics_url, "".join(out)
        # "While it serves": the gateway's requests have been picked by epick.
        while _ok_picks(metrics_url) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _ok_picks(metrics_url) >= 3
        demo.send_signal(signal.SIGTERM)
        rest, _ = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=30)
    out.append(rest)
    stdout = "".join(out)
    stderr.seek(0)
    errors = stderr.read()
    assert demo.returncode == 143, f"{stdout}\n{errors}"
    assert "epick demo — summary" in stdout, stdout
    assert "requests sent" in stdout and "picks per replica" in stdout
    assert "stopped after" in stdout
    assert "Unclosed" not in errors, errors
    assert "Traceback" not in errors, errors
