"""``epick conformance``: exit status, the table, JUnit XML, extra vectors, params files."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from epick.config import BUILTIN_POLICY_DIR
from epick.conformance.cli import main

LOAD = str(BUILTIN_POLICY_DIR / "load.wasm")

MINE = """
kind = "custom"
description = "a policy author's own expectations, no Python involved"

[[case]]
name = "mine/prefers-short-queues"
snapshot.endpoints = [{ address = "e0:8000", waiting = 9 }, { address = "e1:8000", waiting = 1 }]
expect.order = [1, 0]
expect.why = ["short queue", "long queue"]

[[case]]
name = "mine/wrong-on-purpose"
params = { queue_weight = 1.0, kv_weight = 0.0, work_weight = 0.0 }
snapshot.endpoints = [{ address = "e0:8000", waiting = 9 }, { address = "e1:8000", waiting = 1 }]
expect.scores = [1.0, 0.0]
expect.why = ["claimed best", "claimed worst"]
"""


@pytest.fixture
def mine(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(MINE)
    return path


def test_a_conforming_module_exits_0_and_prints_every_row(capsys):
    assert main([LOAD]) == 0

    out = capsys.readouterr().out
    assert "conformance: load (load)" in out
    for word in ("case", "expected", "got", "verdict", "why", "load/queue-spread",
                 "property/memory-stable"):
        assert word in out
    assert "PASS: load (load): 32 passed, 0 failed, 0 errors" in out


def test_an_extra_vector_file_runs_without_python_and_its_failure_exits_1(mine, capsys):
    assert main([LOAD, "--vectors", str(mine)]) == 1

    out = capsys.readouterr().out
    assert "mine/prefers-short-queues" in out
    assert "mine/wrong-on-purpose: endpoint 0 (e0:8000) expected 1 (claimed best), got 0" in out
    assert "FAIL: load (load): 33 passed, 1 failed, 0 errors" in out


def test_junit_output_has_a_suite_per_group_and_a_failure_element_with_the_reason(
    mine, tmp_path, capsys
):
    junit = tmp_path / "out.xml"

    assert main([LOAD, "--vectors", str(mine), "--junit", str(junit)]) == 1

    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites"
    suites = {s.get("name"): s for s in root.findall("testsuite")}
    assert set(suites) == {"load.vectors", "load.properties"}
    vectors = suites["load.vectors"]
    assert (vectors.get("tests"), vectors.get("failures"), vectors.get("errors")) == ("22", "1", "0")
    assert suites["load.properties"].get("tests") == "12"
    failed = [tc for tc in root.iter("testcase") if tc.find("failure") is not None]
    assert [tc.get("name") for tc in failed] == ["mine/wrong-on-purpose"]
    failure = failed[0].find("failure")
    assert failure.get("message") == (
        "mine/wrong-on-purpose: endpoint 0 (e0:8000) expected 1 (claimed best), got 0; "
        "endpoint 1 (e1:8000) expected 0 (claimed worst), got 1"
    )
    assert failure.text.startswith("expected: [1, 0]\ngot: [0, 1]\n")


def test_kind_custom_runs_only_the_properties_and_the_authors_vectors(mine, capsys):
    assert main([LOAD, "--kind", "custom", "--vectors", str(mine)]) == 1

    out = capsys.readouterr().out
    assert "conformance: load (custom)" in out
    assert "load/queue-spread" not in out
    assert "FAIL: load (custom): 13 passed, 1 failed, 0 errors" in out


def test_a_params_file_is_what_the_properties_run_with(tmp_path, capsys):
    params = tmp_path / "params.toml"
    params.write_text("queue_weight = 2.0\nkv_weight = 0.5\n")

    assert main([LOAD, "--params", str(params)]) == 0


def test_params_init_refuses_exit_2_naming_the_param(tmp_path, capsys):
    params = tmp_path / "params.json"
    params.write_text('{"queue_weight": -1}')

    assert main([LOAD, "--params", str(params)]) == 2

    err = capsys.readouterr().err
    assert "error: policy 'load': init refused its params: param 'queue_weight': -1" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(["nope.wasm"], "error: nope.wasm: cannot read module: No such file or directory", id="missing-module"),
        pytest.param([LOAD, "--params", "nope.toml"], "error: nope.toml: cannot read params file: No such file or directory", id="missing-params"),
        pytest.param([LOAD, "--vectors", "nope.toml"], "error: nope.toml: cannot read vector file: No such file or directory", id="missing-vectors"),
    ],
)
def test_what_cannot_be_read_exits_2_naming_it(argv, message, capsys):
    assert main(argv) == 2

    assert message in capsys.readouterr().err.replace("\n", "")


def test_a_vector_file_for_another_kind_exits_2(tmp_path, capsys):
    other = tmp_path / "other.toml"
    other.write_text('kind = "prefix-cache"\n')

    assert main([LOAD, "--vectors", str(other)]) == 2

    err = capsys.readouterr().err.replace("\n", "")
    assert "its kind 'prefix-cache' does not match the policy's kind 'load'" in err


def test_a_file_that_is_not_wasm_exits_2(tmp_path, capsys):
    bogus = tmp_path / "bogus.wasm"
    bogus.write_bytes(b"not wasm")

    assert main([str(bogus)]) == 2

    assert "error: policy 'bogus'" in capsys.readouterr().err


def test_an_unknown_kind_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([LOAD, "--kind", "lora"])

    assert info.value.code == 2
    assert "invalid choice: 'lora'" in capsys.readouterr().err
