"""`epick replay`: the report, the CI threshold and clear refusals."""

from __future__ import annotations

import json

import pytest
from decision_logs import record

from epick.cli import main
from epick.config import resolve_module


@pytest.fixture(scope="module")
def log(tmp_path_factory, runtime):
    path = tmp_path_factory.mktemp("replay") / "d.log"
    record(runtime, path, seconds=4.0)
    return path


def test_the_same_policies_agree_fully_and_pass_a_strict_threshold(log, capsys):
    assert main(["replay", str(log), "--json", "--min-agreement", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["agreement"] == 1.0 and report["decisions"] > 100


def test_a_candidate_below_the_threshold_fails_the_run(log, capsys):
    rc = main(["replay", str(log), "--weights", "load=5",
               "--params", 'lora-affinity={"profile": "upstream"}', "--min-agreement", "0.99"])
    out = capsys.readouterr()
    assert rc == 1
    assert "is below --min-agreement 99.00%" in out.err
    assert "agreement" in out.out and "most changed decisions" in out.out


def test_a_replacement_module_from_a_file(log, capsys):
    rc = main(["replay", str(log), "--policy", f"prefix-cache={resolve_module('load')}",
               "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert any("prefix-cache" in p for p in report["replayed_policies"])


@pytest.mark.parametrize("args, message", [
    (["--weights", "load"], "--weights 'load': expected NAME=VALUE"),
    (["--weights", "load=fast"], "--weights 'load=fast': 'fast' is not a number"),
    (["--weights", "load=-1"], "a weight must be finite and >= 0"),
    (["--weights", "nope=1"], "--weights names policy 'nope', which is neither in the log's "
                              "policy set (load, lora-affinity, prefix-cache)"),
    (["--params", "load=[1]"], "--params 'load=[1]': expected a JSON object"),
    (["--params", "load={x"], "--params 'load={x': not JSON"),
    (["--policy", "load=/nonexistent.wasm"], "cannot read /nonexistent.wasm"),
    (["--min-agreement", "95"], "--min-agreement 95.0: expected a fraction in [0, 1]"),
    (["--params", 'load={"bogus": 1}'], "policy 'load'"),
], ids=["no-value", "nan-weight", "negative", "unknown-policy", "params-list", "params-json",
        "missing-module", "percent", "unknown-param"])
def test_bad_arguments_exit_2_and_say_what_was_wrong(log, capsys, args, message):
    assert main(["replay", str(log), *args]) == 2
    assert message in capsys.readouterr().err


def test_a_replay_in_process_leaves_the_callers_log_level_alone(log, capsys):
    # It quiets epick's loggers while it runs; a full test run once lost the warnings
    # other tests assert on because a replay had set "epick" to ERROR for good.
    import logging

    before = logging.getLogger("epick").level
    assert main(["replay", str(log), "--json"]) == 0
    capsys.readouterr()
    assert logging.getLogger("epick").level == before
