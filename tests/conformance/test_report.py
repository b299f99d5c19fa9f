"""Report: what "passed" means, and the JUnit XML of each verdict."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from epick.conformance.report import CaseResult, Report


def row(name: str, verdict: str, group: str = "vector") -> CaseResult:
    return CaseResult(name=name, expected="[1]", got="[0]", verdict=verdict, why=f"{name}: because", group=group)


def test_a_report_without_cases_has_not_passed():
    assert not Report(module="m", kind="load").passed


def test_a_report_passes_only_when_every_case_passes():
    report = Report(module="m", kind="load", cases=[row("a", "pass"), row("b", "pass", "property")])
    assert report.passed

    report.cases.append(row("c", "error"))
    assert not report.passed
    assert [c.name for c in report.failures] == ["c"]
    assert report.summary() == "FAIL: m (load): 2 passed, 0 failed, 1 errors"


def test_junit_marks_fails_as_failure_and_errors_as_error(tmp_path):
    report = Report(
        module="m", kind="custom",
        cases=[row("v/ok", "pass"), row("v/bad", "fail"), row("property/x", "error", "property")],
    )
    path = tmp_path / "r.xml"

    report.write_junit(path)

    root = ET.parse(path).getroot()
    cases = {tc.get("name"): tc for tc in root.iter("testcase")}
    assert cases["v/ok"].find("failure") is None and cases["v/ok"].find("error") is None
    assert cases["v/bad"].find("failure").get("message") == "v/bad: because"
    assert cases["property/x"].find("error").text == "expected: [1]\ngot: [0]\nproperty/x: because"
    assert [s.get("errors") for s in root.findall("testsuite")] == ["0", "1"]
