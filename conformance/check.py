"""``check``: the whole conformance run for one module — the host's gate before go-live."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from epick.conformance import vectors
from epick.conformance.properties import run_properties
from epick.conformance.report import Report
from epick.conformance.runner import run_cases
from epick.conformance.schema import FILE_KINDS, KINDS
from epick.interfaces import FailureKind, PolicyFailure

__all__ = ["check", "module_kind", "ConformanceError"]


class ConformanceError(PolicyFailure, ValueError):
    """The run cannot start: an unknown kind, a bad vector file, a bad params file (kind
    ``uncheckable``, one of the :class:`~epick.interfaces.PolicyFailure` family)."""

    kind = FailureKind.UNCHECKABLE


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
    builtin_vectors: bool = True,
    runtime=None,
) -> Report:
    """Run the vectors for ``kind`` (plus ``extra_vectors``) and every property.

    ``params`` are the params the module will go live with: the properties run with
    them. Vector cases run with their own params (the file's, then the case's) over the
    policy's defaults, so the normative tables are checked whatever the deployment tunes.
    ``kind`` defaults to what the module's ``describe`` reports; ``custom`` has no
    built-in vectors (properties and ``extra_vectors`` only). ``builtin_vectors=False``
    runs only ``extra_vectors``; ``properties=False`` skips the properties.

    ``module=None`` with ``kind="host"`` checks the host stage alone: the built-in
    ``host`` vectors (and ``extra_vectors``), compiling what they name with ``runtime``.

    Raises :class:`ConformanceError` for an unknown kind or an invalid vector file, and
    the runtime's ``PolicyLoadError`` when ``init`` refuses ``params``. Everything the
    policy gets wrong is in the returned :class:`Report` instead.
    """
    if module is None:
        if kind != "host" or runtime is None:
            raise ConformanceError("no module given: only `--kind host` runs without one")
    elif kind is None:
        kind = module_kind(module, params)
    if kind not in FILE_KINDS:
        raise ConformanceError(f"unknown policy kind {kind!r}; expected one of {', '.join(KINDS)}")
    try:
        cases = vectors.load(kind, extra_vectors, builtin=builtin_vectors)
    except vectors.VectorError as exc:
        raise ConformanceError(str(exc)) from exc
    if module is None:
        selfish = [c.name for c in cases if c.case.host is None or c.case.host.uses_self]
        if selfish:
            raise ConformanceError(f"case {selfish[0]!r} needs a module under test; give "
                                   "MODULE.wasm")
        report = Report(module="host", kind=kind)
        report.cases.extend(run_cases(None, cases, runtime=runtime))
        return report
    module.instantiate(params).close()  # refused params: fail loudly, not as 20 errors
    report = Report(module=module.name, kind=kind)
    report.cases.extend(run_cases(module, cases, runtime=runtime))
    if properties:
        report.cases.extend(run_properties(module, params))
    return report
