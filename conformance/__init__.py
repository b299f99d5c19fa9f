"""The conformance suite: does a policy module do what its kind promises?

Vectors (TOML data under ``conformance/vectors/``, hand-derived from docs/scoring.md's tables)
plus properties every policy must meet (:mod:`epick.conformance.properties`)::

    report = check(module, params)          # kind from the module's describe
    if not report.passed:
        for c in report.failures:
            print(c.why)

The CLI is ``epick conformance MODULE.wasm ...`` (:func:`epick.conformance.cli.main`).
"""

from epick.conformance.check import ConformanceError, check
from epick.conformance.report import CaseResult, Report

__all__ = ["check", "Report", "CaseResult", "ConformanceError"]
