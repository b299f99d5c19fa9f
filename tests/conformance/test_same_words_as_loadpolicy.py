"""Conformance and LoadPolicy name a policy's first problem in the same words: the report
carries the host's own smoke run (``property/loads-like-the-host``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import wasmtime

from epick.conformance import check
from epick.runtime import Limits, PolicyLoadError, Runtime, validate

WAT = Path(__file__).resolve().parents[1] / "runtime" / "wat"

#: A score that differs on every call (a stand-in for a read past the end of an input:
#: garbage that changes between calls).
DRIFTING = """(module
  {abi}
  {msgpack}
  (global $calls (mut i32) (i32.const 0))
  (func (export "init") (param i32 i32) (result i32) (i32.const 0))
  (func (export "score") (param $in i32) (param $len i32) (param $out i32) (result i32)
    (global.set $calls (i32.add (global.get $calls) (i32.const 1)))
    (call $fill (local.get $out) (call $candidates (local.get $in))
                (f64.div (f64.const 1) (f64.convert_i32_u (global.get $calls))))
    (i32.const 0))
)"""


@pytest.fixture
def drifting():
    text = DRIFTING.format(abi=(WAT / "_abi.wat").read_text(),
                           msgpack=(WAT / "_msgpack.wat").read_text())
    with Runtime(Limits(budget_ms=500.0)) as rt:
        yield rt.compile(wasmtime.wat2wasm(text), name="drifting")


def test_conformance_reports_exactly_what_loadpolicy_refuses_with(drifting):
    with pytest.raises(PolicyLoadError) as refused:
        validate(drifting, {})
    assert re.search(r"score is not deterministic: the same input gave different scores "
                     r"\(candidate 0: [\d.e-]+, then [\d.e-]+\); a read past the end of an input "
                     r"\(candidates, endpoints, the prompt\) is the usual cause",
                     str(refused.value))

    report = check(drifting, {}, kind="custom")
    first = report.cases[0]
    assert first.name == "property/loads-like-the-host" and first.verdict == "fail"
    assert first.why == f"property/loads-like-the-host: LoadPolicy would refuse it: {refused.value}"


def test_a_shipped_policy_loads_like_the_host(shipped):
    (row,) = [c for c in check(shipped("load"), {}, properties=True).cases
              if c.name == "property/loads-like-the-host"]
    assert row.verdict == "pass"
