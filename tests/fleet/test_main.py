"""``python -m epick.fleet``: its sub-commands and errors, without vLLM."""

from __future__ import annotations

import signal

import pytest

from epick.fleet import __main__ as cli
from epick.fleet.fleet import FleetError


def test_a_sub_command_is_required():
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2


def test_install_and_build_print_where(monkeypatch, capsys):
    monkeypatch.setattr(cli, "install", lambda: "/x/.venv-vllm/bin/python")
    monkeypatch.setattr(cli, "build_model", lambda: "/x/.cache/vllm-fleet")
    assert cli.main(["install"]) == 0 and cli.main(["build"]) == 0
    assert capsys.readouterr().out.split() == ["/x/.venv-vllm/bin/python", "/x/.cache/vllm-fleet"]


def test_a_fleet_error_is_one_line_on_stderr_and_exit_1(monkeypatch, capsys):
    def fail():
        raise FleetError("no CPython 3.11 found")

    monkeypatch.setattr(cli, "install", fail)
    assert cli.main(["install"]) == 1
    assert capsys.readouterr().err == "error: no CPython 3.11 found\n"


def test_run_starts_the_fleet_prints_its_config_and_stops_on_sigterm(monkeypatch, capsys):
    made = {}

    class Replica:
        def __init__(self, i):
            self.index, self.address, self.pid = i, f"127.0.0.1:{9000 + i}", 100 + i
            self.kv_events_endpoint, self.log_path = f"tcp://127.0.0.1:{5000 + i}", f"r{i}.log"

    class Fleet:
        def __init__(self, n, *, max_loras):
            made.update(n=n, max_loras=max_loras)
            self.replicas = [Replica(i) for i in range(n)]

        def __enter__(self):
            made["entered"] = True
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # as if SIGTERM came
            return self

        def __exit__(self, *exc):
            made["stopped"] = True

    monkeypatch.setattr(cli, "VllmFleet", Fleet)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert cli.main(["run", "--replicas", "3", "--max-loras", "1"]) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert made == {"n": 3, "max_loras": 1, "entered": True, "stopped": True}
    out = capsys.readouterr().out
    assert "replica 2: http://127.0.0.1:9002 pid 102 kv-events tcp://127.0.0.1:5002" in out
    assert out.count("[[pool.endpoints]]") == 3 and 'address = "127.0.0.1:9001"' in out
