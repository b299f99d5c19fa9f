"""The config file: defaults, every validation error names the file, the path and the value."""

import subprocess
import sys
from pathlib import Path

import pytest

from epick import config
from epick.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_config_is_valid_and_complete():
    c = config.load(ROOT / "examples" / "epick.toml")
    assert [e.address for e in c.pool.endpoints] == [
        "127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]
    assert [p.name for p in c.policies] == ["load", "prefix-cache", "lora-affinity"]
    assert c.server.fallbacks == 2 and c.admission.kv_threshold == 0.8


def test_a_minimal_config_gets_the_documented_defaults():
    c = config.loads("version = 1")
    assert c.server.listen == "127.0.0.1:9002"
    assert c.server.metrics_listen == "127.0.0.1:9090"
    assert c.pool.scrape_interval_ms == 50 and c.pool.stale_after_ms == 2000
    assert c.pool.scrape_in == "process" and c.pool.scrape_worker_nice == 10
    assert c.admission.queue_threshold == 5 and c.admin.listen == "127.0.0.1:9003"
    assert c.runtime.budget_ms == 50.0 and c.runtime.memory_mb == 64
    assert c.runtime.fuel == 10_000_000


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "Object missing required field `version`"),
        ("version = 2", "unsupported config version 2; this epick reads version 1"),
        ("version = 1\n[admission]\nkv_threshold = 1.5",
         "Expected `float` <= 1.0 - at `$.admission.kv_threshold`"),
        ("version = 1\n[server]\nlisten = 'nowhere'",
         "Expected `str` matching regex"),
        ("version = 1\n[server]\nfalbacks = 3", "Object contains unknown field `falbacks` - at `$.server`"),
        ("version = 1\n[[pool.endpoints]]\naddress='a:1'\n[[pool.endpoints]]\naddress='a:1'",
         "endpoint 'a:1' is listed twice - at `$.pool`"),
        ("version = 1\n[[policies]]\nname='x'\nmodule='load'\nweight=-1",
         "Expected `float` >= 0.0 - at `$.policies[0].weight`"),
        ("version = 1\n[[policies]]\nname='x'\nmodule='load'\n[[policies]]\nname='x'\nmodule='load'",
         "policy name 'x' is used twice"),
        ("version = 1\n[pool]\nscrape_interval_ms = 0",
         "Expected `int` >= 1 - at `$.pool.scrape_interval_ms`"),
        ("version = 1\n[pool]\nscrape_worker_nice = 20",
         "Expected `int` <= 19 - at `$.pool.scrape_worker_nice`"),
        ("version = 1\n[pool]\nscrape_worker_cpus = [4096]",
         "scrape_worker_cpus: CPU 4096 does not exist (this machine has CPUs 0-"),
        ("version = 1\n[pool]\nscrape_worker_cpus = [0, 0]",
         "scrape_worker_cpus [0, 0] lists a CPU twice"),
        ("version = 1\n[[pool.endpoints]]\naddress='a:1'\nengine='tgi'",
         "at `$.pool.endpoints[0].engine`"),
        ("version = = 1", "not valid TOML"),
    ],
    ids=["no-version", "future-version", "kv-range", "bad-listen", "typo", "dup-endpoint",
         "negative-weight", "dup-policy", "zero-interval", "nice-range", "cpu-unknown",
         "cpu-twice", "bad-engine",
         "not-toml"],
)
def test_invalid_configs_name_the_source_and_the_path(text, message):
    with pytest.raises(config.ConfigError) as info:
        config.loads(text, source="epick.toml")
    assert str(info.value).startswith("epick.toml: ")
    assert message in str(info.value)


def test_builtin_module_names_resolve_to_the_committed_builds(tmp_path):
    assert config.resolve_module("load") == config.BUILTIN_POLICY_DIR / "load.wasm"
    assert config.resolve_module("my.wasm", base=tmp_path) == tmp_path / "my.wasm"


def test_admin_token_comes_from_the_environment_first(monkeypatch):
    c = config.loads("version = 1\n[admin]\ntoken = 'file'")
    assert c.admin.effective_token() == "file"
    monkeypatch.setenv("EPICK_ADMIN_TOKEN", "env")
    assert c.admin.effective_token() == "env"


def test_check_config_exits_0_for_a_good_file(capsys):
    assert main(["check-config", str(ROOT / "examples" / "epick.toml")]) == 0
    assert "ok (version 1, 3 endpoints, 3 policies)" in capsys.readouterr().out


def test_check_config_prints_file_key_and_reason(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("version = 1\n[admission]\nqueue_threshold = -1\n")
    assert main(["check-config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: Expected `int` >= 0 - at `$.admission.queue_threshold`" in err


def test_check_config_reports_a_missing_module_file(tmp_path, capsys):
    bad = tmp_path / "c.toml"
    bad.write_text("version = 1\n[[policies]]\nname = 'x'\nmodule = 'nope.wasm'\n")
    assert main(["check-config", str(bad)]) == 1
    assert "policy 'x' module 'nope.wasm': no such file" in capsys.readouterr().err


def test_an_empty_listen_address_switches_that_listener_off():
    c = config.loads("version = 1\n[server]\nmetrics_listen = ''\n[admin]\nlisten = ''")
    assert c.server.metrics_listen == "" and c.admin.listen == ""
    with pytest.raises(config.ConfigError, match=r"at `\$.server.listen`"):
        config.loads("version = 1\n[server]\nlisten = ''")


def _policy_config(tmp_path, params: str, module: str = "load") -> Path:
    path = tmp_path / "epick.toml"
    path.write_text(
        "version = 1\n[server]\nlisten = '127.0.0.1:0'\nmetrics_listen = ''\n"
        f"[admin]\nlisten = ''\n[runtime]\ncache_dir = '{tmp_path / 'cache'}'\n"
        "[[pool.endpoints]]\naddress = '127.0.0.1:1'\n"
        f"[[policies]]\nname = 'load'\nmodule = '{module}'\nparams = {params}\n")
    return path


def test_check_config_gives_serves_verdict_on_a_misspelt_param(tmp_path, capsys):
    # `kv_limt` passes the TOML schema (params are the policy's); only the policy's own
    # init refuses it — serve did, check-config said "ok".
    path = _policy_config(tmp_path, "{ kv_limt = 0.8 }")
    assert main(["check-config", str(path)]) == 1
    checked = capsys.readouterr().err.strip()
    served = subprocess.run([sys.executable, "-m", "epick.cli", "serve", "--config", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert served.returncode == 2, served.stderr
    assert served.stderr.strip().splitlines()[-1] == f"epick: {checked}"
    assert checked == (
        f"{path}: policy 'load' rejected: policy 'load': init refused its params: unknown "
        "param 'kv_limt' (known: queue_weight, kv_weight, work_weight, work_scale, "
        "recent_requests, recent_ms)")


def test_check_config_runs_the_policys_own_param_checks(tmp_path, capsys):
    path = _policy_config(tmp_path, "{ work_scale = 0.0 }")
    assert main(["check-config", str(path)]) == 1
    assert "param 'work_scale': 0 must be a finite number > 0" in capsys.readouterr().err
    path = _policy_config(tmp_path, "{ work_scale = 4.0 }")
    assert main(["check-config", str(path)]) == 0


def test_check_config_refuses_a_file_that_is_not_a_policy(tmp_path, capsys):
    (tmp_path / "junk.wasm").write_bytes(b"not wasm")
    path = _policy_config(tmp_path, "{}", module=str(tmp_path / "junk.wasm"))
    assert main(["check-config", str(path)]) == 1
    assert "not a WebAssembly module" in capsys.readouterr().err
