"""Flow control on two real vLLM-CPU replicas (issue 26): flood them with SHEDDABLE
requests, then send CRITICAL ones; the CRITICAL ones are dispatched before every
SHEDDABLE request still waiting in epick when they arrived.

Each request goes the way a gateway sends it (Pick through epick, the completion to the
picked replica, ReportCompletion), from its own thread; gRPC and urllib release the GIL
while they wait, so the service's loop is not starved by them. Prints each CRITICAL
request's queue wait and time to its (non-streamed) answer, for the note."""

from __future__ import annotations

import threading
import time

import msgspec
from client import complete
from epick_service import make_config, running

from epick import config as cfg
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.fleet import SERVED_MODEL

N_SHEDDABLE = 16
N_CRITICAL = 3
MAX_TOKENS = 32


def test_critical_requests_are_dispatched_before_the_sheddable_backlog(fleet, tmp_path):
    base = make_config([r.address for r in fleet.replicas], tmp=tmp_path,
                       stale_after_ms=2000, timeout_ms=1000, scrape_interval_ms=50)
    config = msgspec.structs.replace(base, flow_control=cfg.FlowControlConfig(
        enabled=True, queue_threshold=2, starvation_limit=0, ttl_ms=300_000))
    lock = threading.Lock()
    rows: dict[str, dict] = {}
    errors: list[str] = []

    def one(name: str, criticality: int) -> None:
        t0 = time.monotonic()
        try:
            d = svc.picker.Pick(pb.PickRequest(model=SERVED_MODEL, prompt=f"Story {name}.",
                                               criticality=criticality, explain=True),
                                timeout=300)
            picked = time.monotonic()
            status = pb.ERROR
            try:
                complete(d.endpoint, SERVED_MODEL, f"Story {name}.", MAX_TOKENS)
                status = pb.OK
            finally:
                svc.picker.ReportCompletion(pb.CompletionReport(
                    decision_id=d.decision_id, endpoint=d.endpoint, status=status), timeout=10)
            with lock:
                rows[name] = {"sent": t0, "dispatched": picked, "done": time.monotonic(),
                              "queue_wait_ms": d.explanation.queue_wait_ms}
        except Exception as exc:  # surfaced below
            with lock:
                errors.append(f"{name}: {exc!r}")

    with running(config) as svc:
        deadline = time.monotonic() + 60
        while not svc.service.pool.ready():
            assert time.monotonic() < deadline, "no fresh endpoint within 60 s"
            time.sleep(0.1)
        # Every dispatch out of the queue, as the service saw it (its own thread).
        flow = svc.service._decider.flow  # noqa: SLF001
        dispatched: list[tuple[int, float, float]] = []  # (priority, enqueued, left)
        original = flow.on_dispatch

        def spy(ticket):
            dispatched.append((ticket.priority, ticket.enqueued, ticket.left))
            original(ticket)
        svc.call(setattr, flow, "on_dispatch", spy)
        threads = [threading.Thread(target=one, args=(f"shed{i}", pb.SHEDDABLE))
                   for i in range(N_SHEDDABLE)]
        for t in threads:
            t.start()
        # Wait until epick holds part of the flood (the engines are saturated).
        deadline = time.monotonic() + 60
        while svc.call(flow.waiting_in, -1) < 4:
            assert time.monotonic() < deadline, "the SHEDDABLE flood never queued in epick"
            time.sleep(0.05)
        critical = [threading.Thread(target=one, args=(f"crit{i}", pb.CRITICAL))
                    for i in range(N_CRITICAL)]
        for t in critical:
            t.start()
        for t in threads + critical:
            t.join(timeout=600)
    assert not errors, errors
    crit = [rows[f"crit{i}"] for i in range(N_CRITICAL)]
    for i, r in enumerate(crit):
        print(f"CRITICAL {i}: queue wait {r['queue_wait_ms']:.0f} ms, answered "
              f"{r['done'] - r['sent']:.2f} s after it was sent")
    queued_critical = [d for d in dispatched if d[0] == 1]
    late_sheddable = [d for d in dispatched
                      if d[0] == -1 and any(c[1] < d[2] for c in queued_critical)]
    print(f"queued CRITICAL: {len(queued_critical)}; SHEDDABLE dispatched after a CRITICAL "
          f"queued: {len(late_sheddable)}")
    assert queued_critical, "no CRITICAL request waited: nothing was ordered"
    assert late_sheddable, "no SHEDDABLE request was still waiting: nothing was ordered"
    # No SHEDDABLE left the queue while a CRITICAL one waited in it.
    for _, enqueued, left in queued_critical:
        overtaken = [d for d in dispatched if d[0] == -1 and enqueued < d[2] < left]
        assert not overtaken, (enqueued, left, overtaken)
