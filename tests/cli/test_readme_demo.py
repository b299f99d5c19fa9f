"""The README's "Try it against the demo" commands run, as written, against `epick demo`
(what `make demo` runs): the demo prints its ports and serves the admin API with the
token the README uses. If another process holds a default port here, the demo says so and
the test uses the address it printed instead (the only substitution)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = {"pick": "127.0.0.1:9002", "admin": "127.0.0.1:9003",
            "metrics": "http://127.0.0.1:9090/metrics"}
LABELS = {"pick": "epick Pick API", "admin": "epick admin API", "metrics": "epick metrics"}


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- demo-commands:[^\n]*-->\n```\n(.*?)```", text, re.S)
    assert block, "README.md: the demo-commands block is gone"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_every_readme_demo_command_runs_against_the_demo():
    commands = readme_commands()
    assert len(commands) >= 5
    demo = subprocess.Popen(
        [sys.executable, "-m", "epick.cli", "demo", "--duration", "20", "--rate", "2",
         "--replicas", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        seen: dict[str, str] = {}
        deadline = time.monotonic() + 90
        while len(seen) < 3 and time.monotonic() < deadline:
            line = demo.stdout.readline()
            assert line, "the demo ended before printing its addresses"
            for key, label in LABELS.items():
                if line.startswith(label):
                    seen[key] = line[len(label):].split()[0]
        results = []
        for command in commands:
            for key, default in DEFAULTS.items():
                command = command.replace(default, seen[key])
            results.append(subprocess.run(["bash", "-c", command], cwd=ROOT,
                                          capture_output=True, text=True, timeout=60))
        for command, r in zip(commands, results):
            assert r.returncode == 0, f"{command}\n{r.stdout}\n{r.stderr}"
        listed, pick, health, policies, loaded, metrics = (r.stdout for r in results)
        assert "epick.v1.EndpointPicker" in listed
        answer = json.loads(pick)
        rows = answer["explanation"]["candidates"]
        assert [r["rank"] for r in rows if r["endpoint"] == answer["endpoint"]] == [0]
        assert json.loads(health) == {"status": "SERVING"}
        assert [p["name"] for p in json.loads(policies)["policies"]] == [
            "load", "prefix-cache", "lora-affinity"]
        assert json.loads(loaded)["origin"] == "admin" and json.loads(loaded)["shadow"]
        assert 'epick_picks_total{outcome="ok"}' in metrics
        # SIGTERM stops the demo and its children (the fleet, epick serve), not just it.
        children = _children(demo.pid)
        assert len(children) == 2
        demo.terminate()
        assert demo.wait(timeout=60) == 143
        assert _wait_gone(children), f"left running: {children}"
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=60)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _wait_gone(pids: list[int], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() for p in pids):
            return True
        time.sleep(0.1)
    return False
