"""The outcome of a conformance run: one :class:`CaseResult` per vector and property.

Verdicts:

    pass    the case produced what was expected
    fail    the policy answered, but wrongly (a score, an order, a mask, a property)
    error   the policy could not be run on the case (trap, timeout, refused input/params)

:meth:`Report.write_junit` writes the JUnit XML CI systems read.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = ["Verdict", "CaseResult", "Report"]

Verdict = Literal["pass", "fail", "error"]


@dataclass(frozen=True, slots=True)
class CaseResult:
    """One row of the report.

    ``expected`` and ``got`` are short renderings for the table; ``why`` says in plain
    words what differed (failures) or what was derived (passes), naming the case.
    """

    name: str
    expected: str
    got: str
    verdict: Verdict
    why: str
    group: Literal["vector", "property"] = "vector"
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"


@dataclass(slots=True)
class Report:
    """Every case of one run against one policy module."""

    module: str
    kind: str
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True only when there was at least one case and every case passed."""
        return bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.passed]

    def summary(self) -> str:
        n_fail = sum(c.verdict == "fail" for c in self.cases)
        n_err = sum(c.verdict == "error" for c in self.cases)
        n_ok = len(self.cases) - n_fail - n_err
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict}: {self.module} ({self.kind}): {n_ok} passed, "
            f"{n_fail} failed, {n_err} errors"
        )

    def to_junit(self) -> ET.ElementTree:
        """The report as JUnit XML: one testsuite per group (vectors, properties)."""
        root = ET.Element("testsuites", name=f"epick conformance: {self.module}")
        for group, plural in (("vector", "vectors"), ("property", "properties")):
            rows = [c for c in self.cases if c.group == group]
            suite = ET.SubElement(
                root,
                "testsuite",
                name=f"{self.kind}.{plural}",
                tests=str(len(rows)),
                failures=str(sum(c.verdict == "fail" for c in rows)),
                errors=str(sum(c.verdict == "error" for c in rows)),
                time=f"{sum(c.seconds for c in rows):.6f}",
            )
            for c in rows:
                tc = ET.SubElement(
                    suite,
                    "testcase",
                    classname=f"{self.kind}.{plural}",
                    name=c.name,
                    time=f"{c.seconds:.6f}",
                )
                if c.verdict != "pass":
                    tag = "failure" if c.verdict == "fail" else "error"
                    el = ET.SubElement(tc, tag, message=c.why, type=tag)
                    el.text = f"expected: {c.expected}\ngot: {c.got}\n{c.why}"
        ET.indent(root)
        return ET.ElementTree(root)

    def write_junit(self, path: Path | str) -> None:
        self.to_junit().write(path, encoding="utf-8", xml_declaration=True)
