"""``check``: the whole conformance run for one module — the host's gate before go-live."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from epick.conformance import vectors
from epick.conformance.properties import run_properties
from epick.conformance.report import Report
from epick.conformance.runner import run_cases
from epick.conformance.schema import KINDS

__all__ = ["check", "module_kind", "ConformanceError"]


class ConformanceError(ValueError):
    """The run cannot start: an unknown kind, a bad vector file, params init refuses."""


def module_kind(module, params: dict | None = None) -> str:
    """The kind the module's ``describe`` reports (``custom`` without ``describe``)."""
    inst = module.instantiate(params or {})
    try:
        return inst.describe().kind
    finally:
        inst.close()


def check(
    module,
    params: dict,
    *,
    kind: str | None = None,
    extra_vectors: Iterable[Path | str] = (),
    properties: bool = True,
) -> Report:
    """Run the vectors for ``kind`` (plus ``extra_vectors``) and every property.

    ``params`` are the params the module will go live with: the properties run with
    them. Vector cases run with their own params (the file's, then the case's) over the
    policy's defaults, so the normative tables are checked whatever the deployment tunes.
    ``kind`` defaults to what the module's ``describe`` reports; ``custom`` has no
    built-in vectors (properties and ``extra_vectors`` only).

    Raises :class:`ConformanceError` for an unknown kind or an invalid vector file, and
    the runtime's ``PolicyLoadError`` when ``init`` refuses ``params``. Everything the
    policy gets wrong is in the returned :class:`Report` instead.
    """
    if kind is None:
        kind = module_kind(module, params)
    if kind not in KINDS:
        raise ConformanceError(f"unknown policy kind {kind!r}; expected one of {', '.join(KINDS)}")
    try:
        cases = vectors.load(kind, extra_vectors)
    except vectors.VectorError as exc:
        raise ConformanceError(str(exc)) from exc
    module.instantiate(params).close()  # refused params: fail loudly, not as 20 errors
    report = Report(module=module.name, kind=kind)
    report.cases.extend(run_cases(module, cases))
    if properties:
        report.cases.extend(run_properties(module, params))
    return report
