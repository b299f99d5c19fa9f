"""OpenTelemetry tracing of decisions: one span per pick, W3C trace context in and out.

Off by default (``[tracing] enabled``); then nothing here runs: the :class:`Decider`
holds ``tracer = None`` and a pick pays one attribute check (docs/tracing.md). On, every
pick goes through :meth:`PickTracer.decide`:

1. the caller's ``traceparent`` / ``tracestate`` are read (W3C Trace Context, the SDK's
   own propagator) from the front end's carrier — gRPC call metadata, the HTTP front
   end's request headers — and then from the ``PickRequest``'s own ``headers`` map,
   which wins (a PickStream message's, or the request headers ext_proc and ``/v1/route``
   copy into it);
2. the sampling decision (``sample_ratio``, following the caller's sampled flag when
   ``parent_based``) is taken before the SDK is asked for anything: the caller's header
   is checked with the propagator's own pattern, and the ratio is the SDK's
   ``TraceIdRatioBased`` rule on the caller's trace id (a root pick draws at random, as
   the SDK's fresh trace id would). An unsampled pick is then decided exactly as with
   tracing off and no span is made: the cost of the 99% at 1% sampling is a header
   lookup and a pattern match. Its ext_proc answer sets no trace header, so the model
   server gets the caller's own context unchanged;
3. a sampled pick is decided with the explanation on (it is dropped again from the
   answer unless the client asked for it) and its span gets the stages as events:
   ``filter`` (candidates, kept, how many each filter dropped), ``score`` (each policy's
   score and the total of the chosen endpoint and the runner-up), ``flow_control.wait``
   (when the decision waited in a queue: the hook for flow control, see
   :func:`_flow_wait`), ``pick`` (endpoint, fallbacks), and the refusal as the status.

Spans leave through the SDK's ``BatchSpanProcessor`` (a bounded queue and its own export
thread: a slow or absent collector costs a pick nothing; a full queue drops spans) and
the OTLP/gRPC exporter.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["PickTracer", "TRACE_HEADERS", "SPAN_NAME", "parent_of"]

#: The headers epick reads and passes on (W3C Trace Context).
TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "epick.pick"

_PROPAGATOR = TraceContextTextMapPropagator()


class _CarrierGetter(Getter):
    """Reads a trace header from a ``PickRequest``'s headers map first, then from the front
    end's carrier: a gRPC servicer context (its invocation metadata, read only here, so a
    pick with tracing off never touches it) or any mapping of header names."""

    __slots__ = ()

    def get(self, carrier, key: str):
        value = _header(carrier[0], carrier[1], key)
        return [value] if value else None

    def keys(self, carrier):
        return list(TRACE_HEADERS)


def _header(headers, outer, key: str) -> str | None:
    """``key`` from a ``PickRequest``'s headers map, else from the front end's carrier (a
    gRPC context, whose metadata is read only here, or a mapping of HTTP headers)."""
    value = headers.get(key) if headers is not None else None
    if value or outer is None:
        return value or None
    metadata = getattr(outer, "invocation_metadata", None)
    if metadata is None:  # HTTP headers (case-insensitive in aiohttp)
        return outer.get(key) or None
    for k, v in metadata() or ():  # gRPC: lower-case keys
        if k == key:
            return v if isinstance(v, str) else v.decode("latin-1")
    return None


_GETTER = _CarrierGetter()
_TRACEPARENT = re.compile(TraceContextTextMapPropagator._TRACEPARENT_HEADER_FORMAT_RE)
_MAX_TRACEPARENT = TraceContextTextMapPropagator._TRACEPARENT_MAXIMUM_LENGTH
#: The common case, version 00 exactly (what the SDK's pattern accepts for it, no tail).
_TRACEPARENT_00 = re.compile(r"[ \t]*00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})[ \t]*")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


def parent_of(header: str) -> tuple[int, bool] | None:
    """(trace id, sampled flag) of a ``traceparent`` the SDK's propagator would accept,
    else None (its own pattern and rules: length, zero ids, versions ``00`` and ``ff``)."""
    if len(header) > _MAX_TRACEPARENT:
        return None
    m = _TRACEPARENT_00.fullmatch(header)
    if m is not None:
        trace_id, span_id, flags = m.groups()
        if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
            return None
        return int(trace_id, 16), bool(int(flags, 16) & 1)
    m = _TRACEPARENT.search(header)
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.group(1, 2, 3, 4, 5)
    if (trace_id == "0" * 32 or span_id == "0" * 16 or version == "ff"
            or (version == "00" and rest)):
        return None
    return int(trace_id, 16), bool(int(flags, 16) & 1)


def _flow_wait(span, verdict) -> None:
    """The flow-control stage, when the pick waited in epick's queue (docs/flow-control.md):
    an event with the wait and why (the verdict's ``queue_wait_ms`` / ``queue_reason``)."""
    wait_ms = getattr(verdict, "queue_wait_ms", 0.0)
    if not wait_ms and not getattr(verdict, "queue_reason", ""):
        return
    span.add_event("flow_control.wait", {
        "epick.queue_wait_ms": float(wait_ms),
        "epick.queue_reason": str(getattr(verdict, "queue_reason", "") or ""),
    })


def _stage_events(span, decision, request) -> None:
    rows = decision.explanation or ()
    dropped: dict[str, int] = {}
    ranked = []
    for row in rows:
        if row.rank >= 0:
            ranked.append(row)
        elif row.filtered_by or row.reason:
            key = row.filtered_by or "unavailable"
            dropped[key] = dropped.get(key, 0) + 1
    attrs: dict[str, object] = {"epick.endpoints": len(rows), "epick.kept": len(ranked)}
    for name, n in dropped.items():
        attrs[f"epick.filtered_by.{name}"] = n
    span.add_event("filter", attrs)
    ranked.sort(key=lambda r: r.rank)
    attrs = {}
    for role, row in zip(("chosen", "runner_up"), ranked, strict=False):
        attrs[f"epick.{role}.endpoint"] = row.endpoint
        attrs[f"epick.{role}.total"] = row.total
        for policy, score in row.scores.items():
            attrs[f"epick.{role}.score.{policy}"] = score
    if decision.skipped:
        attrs["epick.skipped_policies"] = list(decision.skipped)
    span.add_event("score", attrs)
    span.add_event("pick", {"epick.endpoint": decision.endpoint,
                            "epick.fallbacks": list(decision.fallbacks)})


def check_otlp() -> None:
    """Raise a clear error when the OTLP exporter cannot load. The usual cause: xds-protos
    (Envoy's protos, which ext_proc uses) carries an old copy of opentelemetry-proto's files
    in the same folder, and whichever of the two pip installed last wins; `make install`
    reinstalls opentelemetry-proto after everything else for this reason."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # noqa: F401
            OTLPSpanExporter,
        )
    except ImportError as exc:
        raise RuntimeError(
            f"[tracing]: the OTLP exporter does not load ({exc}); xds-protos has probably "
            "overwritten opentelemetry-proto's files: run `pip install --force-reinstall "
            "--no-deps opentelemetry-proto` in this environment") from exc


class PickTracer:
    """Spans for decisions, exported over OTLP; built by the service from ``[tracing]``.

    ``exporter`` is the seam: tests and benchmarks may hand in any SDK ``SpanExporter``
    (default: OTLP/gRPC to ``endpoint``). :meth:`shutdown` flushes and stops the export
    thread (the service calls it when it stops).
    """

    def __init__(self, *, endpoint: str = "http://127.0.0.1:4317",
                 service_name: str = "epick", sample_ratio: float = 1.0,
                 parent_based: bool = True, insecure: bool = True,
                 headers: Mapping[str, str] | None = None, export_timeout_ms: int = 10_000,
                 schedule_delay_ms: int = 1000, max_queue: int = 2048,
                 max_export_batch: int = 512, resource: Mapping[str, str] | None = None,
                 exporter: SpanExporter | None = None) -> None:
        if exporter is None:
            check_otlp()
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter,
            )

            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure,
                                        headers=dict(headers or {}) or None,
                                        timeout=export_timeout_ms / 1000)
        self._exporter = exporter
        self.sample_ratio = sample_ratio
        self.parent_based = parent_based
        # The SDK's own ratio rule on a trace id (what every OpenTelemetry service uses).
        self._bound = TraceIdRatioBased.get_bound_for_rate(sample_ratio)
        self._id_mask = TraceIdRatioBased.TRACE_ID_LIMIT
        # Sampling is decided in :meth:`sampled` before a span exists; a span the SDK is
        # asked for is one to record.
        self.provider = TracerProvider(
            resource=Resource.create({**(resource or {}), "service.name": service_name}),
            sampler=ALWAYS_ON)
        self.provider.add_span_processor(BatchSpanProcessor(
            exporter, max_queue_size=max_queue, schedule_delay_millis=schedule_delay_ms,
            max_export_batch_size=min(max_export_batch, max_queue),
            export_timeout_millis=export_timeout_ms))
        self.tracer = self.provider.get_tracer("epick")
        self._start_span = self.tracer.start_span

    def sampled(self, traceparent: str | None) -> bool:
        """Whether a pick whose caller sent ``traceparent`` (None: none) is traced: the
        caller's flag (``parent_based``), else the SDK's ratio rule on its trace id; a
        pick without a valid one draws at random with the ratio."""
        parent = parent_of(traceparent) if traceparent else None
        if parent is None:
            return random.random() < self.sample_ratio
        if self.parent_based:
            return parent[1]
        return (parent[0] & self._id_mask) < self._bound

    def decide(self, decider, msg, *, subset, started: float, carrier):
        """Decide ``msg`` through ``decider``, inside a span when it is sampled; a traced
        verdict carries the span's context (``Verdict.trace``) for a front end that passes
        it on."""
        if not self.wants(msg, carrier):
            return decider.decide(msg, subset=subset, started=started, explain=msg.explain)
        verdict = decider.decide(msg, subset=subset, started=started, explain=True)
        return self.record(msg, verdict, started=started, carrier=carrier)

    def wants(self, msg, carrier) -> bool:
        """Whether the pick ``msg`` is traced (then it is decided with an explanation,
        which :meth:`record` turns into the stage events)."""
        return self.sampled(_header(msg.headers, carrier, "traceparent"))

    def record(self, msg, verdict, *, started: float, carrier):
        """The span of a pick :meth:`wants` traced and that is now decided (it starts
        when the front end began on the request: a flow-control wait is inside it)."""
        parent = _PROPAGATOR.extract((msg.headers, carrier), Context(), getter=_GETTER)
        # The span starts when the front end began on the request, on the wall clock.
        start_ns = time.time_ns() - int((time.perf_counter() - started) * 1e9)
        span = self._start_span(SPAN_NAME, parent, kind=SpanKind.SERVER, start_time=start_ns)
        verdict.trace = span.get_span_context()
        try:
            span.set_attribute("epick.outcome", verdict.outcome)
            if msg.model:
                span.set_attribute("epick.model", msg.model)
            if msg.adapter:
                span.set_attribute("epick.adapter", msg.adapter)
            _flow_wait(span, verdict)
            decision = verdict.decision
            if decision is None:
                span.set_status(Status(StatusCode.ERROR, f"{verdict.outcome}: {verdict.message}"))
            else:
                span.set_attribute("epick.decision_id", decision.decision_id)
                span.set_attribute("epick.endpoint", decision.endpoint)
                span.set_attribute("epick.snapshot_version", decision.snapshot_version)
                _stage_events(span, decision, msg)
                if not msg.explain:  # asked for by the trace, not by the client
                    decision.explanation = None
        finally:
            span.end()
        return verdict

    @staticmethod
    def outgoing(span_context) -> dict[str, str]:
        """The ``traceparent`` (and ``tracestate``) naming ``span_context`` as the parent:
        what ext_proc sets on the request it sends to the model server."""
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, trace.set_span_in_context(trace.NonRecordingSpan(span_context)))
        return out

    def force_flush(self, timeout_ms: int = 30_000) -> bool:
        return self.provider.force_flush(timeout_ms)

    def shutdown(self, timeout_ms: int = 2000) -> None:
        """Export what is queued (for at most ``timeout_ms``), then stop: an unreachable
        collector holds a stopping service for that long, not for the exporter's retries."""
        # The SDK's flush has no deadline of its own (an export retries for up to
        # export_timeout_ms); shutting the exporter down ends a retry at once.
        timer = threading.Timer(timeout_ms / 1000, self._exporter.shutdown)
        timer.start()
        try:
            self.provider.shutdown()
        finally:
            timer.cancel()
