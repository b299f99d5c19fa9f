"""The vector format beyond one call: sequences, state assertions, statistical cases and
host-stage cases. Each catches a wrong expectation (so a wrong policy) with a sentence
naming the step, and the format refuses a malformed case by name."""

from __future__ import annotations

import pytest

from epick.config import BUILTIN_POLICY_DIR
from epick.conformance import check, vectors
from epick.conformance.cli import main
from epick.conformance.runner import run_case
from epick.conformance.vectors import VectorError

LORA = str(BUILTIN_POLICY_DIR / "lora-affinity.wasm")
LOAD = str(BUILTIN_POLICY_DIR / "load.wasm")

POOL = """snapshot.timestamp_ms = 1000
snapshot.endpoints = [
  { address = "e0:8000", max_lora = 2 },
  { address = "e1:8000", max_lora = 2, running_adapters = ["b", "c"] },
]
"""


def run(tmp_path, shipped, kind: str, module: str, body: str):
    path = tmp_path / "v.toml"
    path.write_text(f'kind = "{kind}"\n' + body)
    (loaded,) = vectors.load(kind, [path], builtin=False)
    return run_case(shipped(module), loaded)


def test_a_sequence_names_the_step_that_differs(tmp_path, shipped):
    # A policy that forgot to record the pick would score 0.75 at steps[2]; so does this
    # expectation of "no history", on the real policy: the failure names the step.
    r = run(tmp_path, shipped, "lora-affinity", "lora-affinity", f"""[[case]]
name = "seq"
{POOL}steps = [
  {{ event = "pick", request = {{ adapter = "a", request_id = "r1" }}, expect = "e0:8000" }},
  {{ event = "check", request = {{ adapter = "a" }}, expect.scores = [0.75, 0.0], expect.why = ["no history?", "full"] }},
]
""")
    assert r.verdict == "fail"
    assert r.why == ("seq: steps[1] (check): endpoint 0 (e0:8000) expected 0.75 (no history?), "
                     "got 1")


def test_a_pick_step_says_what_was_picked_and_the_scores(tmp_path, shipped):
    r = run(tmp_path, shipped, "lora-affinity", "lora-affinity", f"""[[case]]
name = "pick"
{POOL}steps = [{{ event = "pick", request = {{ adapter = "a" }}, expect = "e1:8000", why = "wrong on purpose" }}]
""")
    assert r.why == ("pick: steps[0] (pick): expected e1:8000 to be picked (wrong on purpose), "
                     "got e0:8000 (scores [0.75, 0])")


def test_state_steps_walk_the_exported_state(tmp_path, shipped):
    r = run(tmp_path, shipped, "lora-affinity", "lora-affinity", f"""[[case]]
name = "state"
{POOL}steps = [
  {{ event = "pre_request", request = {{ adapter = "a" }}, endpoint = "e1:8000", timestamp_ms = 1000 }},
  {{ event = "state", path = [2, 1, 1, 0], equals = ["a", 2, 1000], why = "two in flight?" }},
  {{ event = "state", path = [2], length = 3 }},
  {{ event = "state", path = [9] , length = 0 }},
]
""")
    assert r.verdict == "fail"
    assert r.why.startswith(
        "state: steps[1] (state): expected state[2][1][1][0] = ['a', 2, 1000] (two in flight?), "
        "got ['a', 1, 1000]; steps[2] (state): expected state[2] to have 3 elements, got 2: "
        "[['e0:8000', []], ['e1:8000', [['a', 1, 1000]]]]; steps[3] (state): state has no [9]")


def test_a_state_step_on_a_policy_without_state_says_so(tmp_path, shipped):
    r = run(tmp_path, shipped, "load", "load", """[[case]]
name = "stateless"
snapshot.endpoints = [{ address = "e0:8000" }]
steps = [{ event = "state", length = 0 }]
""")
    assert r.why == ("stateless: steps[0] (state): the policy does not export export_state "
                     "(no observable state)")


def test_a_statistical_case_reports_each_candidates_share(tmp_path, shipped):
    r = run(tmp_path, shipped, "legacy-v1", "legacy-v1", """[[case]]
name = "draw"
params = { affinity_probability = 0.7 }
request = { criticality = 0, adapter = "a" }
snapshot.endpoints = [
  { address = "e0:8000", running_adapters = ["a"], max_lora = 2 },
  { address = "e1:8000", max_lora = 2 },
]
stats = { seeds = 1000, frequencies = [0.5, 0.5], tolerance = 0.05, why = "a fair coin?" }
""")
    assert r.verdict == "fail"
    assert r.why.startswith("draw: endpoint 0 (e0:8000) picked 7")
    assert "of 1000 seeds, expected 50.0% ± 5.0% (a fair coin?); endpoint 1 (e1:8000) picked" \
        in r.why


def test_a_host_stage_case_runs_the_module_under_test_beside_fixed_policies(tmp_path, shipped):
    r = run(tmp_path, shipped, "load", "load", """[[case]]
name = "beside"
snapshot.endpoints = [{ address = "e0:8000", waiting = 8 }, { address = "e1:8000", waiting = 2 }]
host.policies = [{ name = "self", module = "self" }, { name = "sticky", scores = [1.0, 0.0], weight = 0.6 }]
host.expect.pick = "e1:8000"
host.expect.totals = [1.1, 0.9]
host.expect.why = "load alone prefers e1 (0.9 vs 0.5); sticky's 0.6 is not enough?"
""")
    assert r.verdict == "fail"
    assert r.why == ("beside: expected e1:8000 to be picked (load alone prefers e1 (0.9 vs 0.5); "
                     "sticky's 0.6 is not enough?), got e0:8000")


@pytest.mark.parametrize("body, message", [
    ('[[case]]\nname = "x"\nsnapshot.endpoints = [{ address = "e0" }]\n'
     'steps = [{ event = "state", path = [0] }]\n',
     "a state step needs exactly one of `equals`, `length`"),
    ('[[case]]\nname = "x"\nsnapshot.endpoints = [{ address = "e0" }]\n'
     'steps = [{ event = "pre_request", endpoint = "e0" }]\n',
     "case 'x': its steps check nothing: add a `check`, `pick` or `state` step, or `expect`"),
    ('[[case]]\nname = "x"\nsnapshot.endpoints = [{ address = "e0" }]\n',
     "case 'x': nothing to check: give `expect`, `steps` (with a check, pick or state step), "
     "`stats` or `host`"),
    ('[[case]]\nname = "x"\nsnapshot.endpoints = [{ address = "e0" }]\n'
     'stats = { frequencies = [0.5, 0.5] }\n',
     "case 'x': stats.frequencies has 2 values for 1 candidates"),
    ('[[case]]\nname = "x"\nsnapshot.endpoints = [{ address = "e0" }]\n'
     'host.policies = [{ name = "a", scores = [1.0], module = "load" }]\nhost.expect.pick = "e0"\n',
     "host policy 'a' needs exactly one of `module`, `scores`, `keep`; got `module`, `scores`"),
    ('[[case]]\nname = "x"\nsnapshot.endpoints = [{ address = "e0" }]\n'
     'host.policies = [{ name = "a", scores = [1.0, 0.5] }]\nhost.expect.pick = "e0"\n',
     "case 'x': host policy 'a' has 2 scores for 1 endpoints"),
    ('[[case]]\nname = "x"\nsnapshot.endpoints = [{ address = "e0" }]\ncandidates = [0]\n'
     'host.expect.pick = "e0"\n',
     "case 'x': a host-stage case scores every endpoint (the host filters decide): leave out "
     "`candidates`"),
    ('[[case]]\nname = "x"\nsnapshot.endpoints = [{ address = "e0" }]\n'
     'host.expect.outcome = "shed"\nhost.expect.totals = [1.0]\n',
     "host.expect: `outcome` cannot go with `fallbacks`, `totals` or `filtered` (nothing was "
     "picked)"),
])
def test_a_malformed_case_is_refused_by_name(tmp_path, body, message):
    path = tmp_path / "bad.toml"
    path.write_text('kind = "custom"\n' + body)
    with pytest.raises(VectorError) as info:
        vectors.load_file(path)
    assert message in str(info.value)


def test_a_host_file_cannot_use_self(tmp_path):
    path = tmp_path / "h.toml"
    path.write_text('kind = "host"\n[[case]]\nname = "x"\nsnapshot.endpoints = [{ address = "e0" }]\n'
                    'host.expect.pick = "e0"\n')
    with pytest.raises(VectorError) as info:
        vectors.load_file(path)
    assert "a `kind = \"host\"` file has no module under test: name a built-in or a path " \
           "instead of `self`" in str(info.value)


def test_the_builtin_host_vectors_pass(runtime):
    report = check(None, {}, kind="host", runtime=runtime)
    assert report.passed, "\n".join(c.why for c in report.failures)
    assert len(report.cases) >= 10 and all(c.name.startswith("host/") for c in report.cases)


def test_only_runs_just_the_given_files_and_no_properties_skips_them(tmp_path, capsys):
    path = tmp_path / "mine.toml"
    path.write_text('kind = "custom"\n[[case]]\nname = "mine/one"\n'
                    'snapshot.endpoints = [{ address = "e0:8000" }]\n'
                    'expect.scores = [1.0]\nexpect.why = "idle"\n')
    assert main([LOAD, "--vectors", str(path), "--only", "--no-properties"]) == 0
    out = capsys.readouterr().out
    assert "mine/one" in out and "load/queue-spread" not in out and "property/" not in out
    assert "PASS: load (load): 1 passed, 0 failed, 0 errors" in out
    assert main([LOAD, "--no-properties"]) == 0
    out = capsys.readouterr().out
    assert "load/queue-spread" in out and "property/" not in out


def test_kind_host_runs_without_a_module(capsys):
    assert main(["--kind", "host"]) == 0
    assert "PASS: host (host): " in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    ([], "MODULE.wasm is required (only --kind host runs without one)"),
    ([LOAD, "--only"], "--only runs only the --vectors files: give at least one"),
])
def test_cli_misuse_is_named(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
