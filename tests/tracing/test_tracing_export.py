"""The exporter's life: queued spans leave at shutdown, and an unreachable collector holds
a stopping service for the shutdown's bound, not for the exporter's retries."""

from __future__ import annotations

import time

from otlp_receiver import free_port

from epick.tracing import PickTracer


def test_shutdown_exports_what_is_queued(collector):
    t = PickTracer(endpoint=collector.grpc_endpoint, schedule_delay_ms=60_000)
    span = t.tracer.start_span("queued")
    span.end()
    trace_id = span.get_span_context().trace_id.to_bytes(16, "big")
    t.shutdown()
    assert [s.name for s in collector.sink.wait(trace_id)] == ["queued"]


def test_an_unreachable_collector_delays_shutdown_by_its_bound_only():
    t = PickTracer(endpoint=f"http://127.0.0.1:{free_port()}", schedule_delay_ms=60_000,
                   export_timeout_ms=30_000)
    t.tracer.start_span("lost").end()
    t0 = time.monotonic()
    t.shutdown(timeout_ms=500)
    assert time.monotonic() - t0 < 3.0
