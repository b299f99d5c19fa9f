"""EndpointPicker/WatchWeights end to end: real gRPC, real scraped pages, real policies."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import grpc
import msgspec
import pytest
from epick_service import make_config, running
from fakes import vllm_page

from epick import abi
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.config import WeightsConfig


def wait_for(predicate, timeout=5.0, step=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


@pytest.fixture
def serve_weights(tmp_path):
    """``serve_weights(addresses, policies=..., **weights)``: a running service whose
    ``[weights]`` table is ``weights`` (threshold 0 and no interval by default, so every
    new snapshot that changes a share is a message)."""
    stack = []

    def start(addresses, *, policies=("load",), **weights):
        weights = {"threshold": 0.0, "min_interval_ms": 0, **weights}
        # scrape on the loop: a scrape worker restarted on a busy machine would make
        # the first table UNAVAILABLE
        config = msgspec.structs.replace(make_config(addresses, policies=policies,
                                                     tmp=tmp_path, scrape_in="loop"),
                                         weights=WeightsConfig(**weights))
        cm = running(config)
        stack.append(cm)
        return cm.__enter__()

    yield start
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


class Reader:
    """Reads a WatchWeights stream on a thread of its own into a queue."""

    def __init__(self, svc, **request):
        request.setdefault("model", "m")
        self.call = svc.picker.WatchWeights(pb.WeightsRequest(**request), timeout=30)
        self.tables: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for table in self.call:
                self.tables.put(table)
        except grpc.RpcError as exc:
            self.tables.put(exc)

    def next(self, timeout=5.0) -> pb.WeightsTable:
        got = self.tables.get(timeout=timeout)
        if isinstance(got, Exception):
            raise got
        return got

    def until(self, predicate, timeout=5.0) -> pb.WeightsTable:
        deadline = time.monotonic() + timeout
        while True:
            table = self.next(timeout=max(deadline - time.monotonic(), 0.01))
            if predicate(table):
                return table

    def close(self):
        self.call.cancel()
        self.thread.join(timeout=5)


def weights(table) -> dict[str, float]:
    return {e.endpoint: e.weight for e in table.endpoints}


def row(table, address):
    return next(e for e in table.endpoints if e.endpoint == address)


def test_shares_sum_to_one_and_follow_the_scores(fake_vllm, serve_weights):
    servers = [fake_vllm(vllm_page(waiting=q)) for q in (0, 2, 4)]
    svc = serve_weights([s.address for s in servers])
    reader = Reader(svc)
    table = reader.next()
    w = weights(table)
    assert set(w) == {s.address for s in servers}
    assert sum(w.values()) == pytest.approx(1.0)
    assert w[servers[0].address] > w[servers[1].address] > w[servers[2].address] > 0
    assert table.snapshot_version > 0 and table.timestamp_ms > 0
    assert table.reason == ""
    reader.close()


def test_a_saturated_replica_gets_zero_and_a_stale_one_drops_out(fake_vllm, serve_weights):
    a, b, c = (fake_vllm(vllm_page(waiting=1)) for _ in range(3))
    svc = serve_weights([a.address, b.address, c.address])
    reader = Reader(svc)
    assert all(v > 0 for v in weights(reader.next()).values())
    b.page = vllm_page(waiting=50)  # over the admission queue threshold (5)
    table = reader.until(lambda t: weights(t)[b.address] == 0)
    assert row(table, b.address).filtered_by == "saturated"
    assert sum(weights(table).values()) == pytest.approx(1.0)
    c.stop()  # its page is gone: stale after 400 ms, weight 0, named by the fresh filter
    table = reader.until(lambda t: weights(t).get(c.address, 0) == 0
                         and row(t, c.address).filtered_by == "fresh")
    assert weights(table)[a.address] == pytest.approx(1.0)
    reader.close()


def test_an_adapter_request_favours_replicas_where_it_is_resident(fake_vllm, serve_weights):
    servers = [fake_vllm(vllm_page(running_adapters=a, max_lora=1))
               for a in ("x", "sql-lora", "y")]
    svc = serve_weights([s.address for s in servers],
                        policies=("load", "prefix-cache", "lora-affinity"))
    reader = Reader(svc, adapter="sql-lora")
    w = weights(reader.next())
    resident = w[servers[1].address]
    assert sum(w.values()) == pytest.approx(1.0)
    assert resident > w[servers[0].address] and resident > w[servers[2].address]
    base = Reader(svc)  # the base model: no replica is favoured for an adapter
    wb = weights(base.next())
    assert wb[servers[1].address] < resident
    reader.close()
    base.close()


def test_a_slow_reader_gets_the_latest_table_not_a_backlog(fake_vllm, serve_weights):
    a, b = fake_vllm(vllm_page(waiting=0)), fake_vllm(vllm_page(waiting=0))
    svc = serve_weights([a.address, b.address])
    hub = svc.service.weights
    pool = svc.service.pool

    async def slow_reader(changes: int) -> tuple[int, int, int, int]:
        """Subscribe on the service's loop, read one table, then sleep through
        ``changes`` page changes before reading again."""
        async with hub.subscribe("m") as sub:
            first = await sub.next()
            for q in range(1, changes + 1):
                version = pool.view.version
                b.page = vllm_page(waiting=q % 5)
                while pool.view.version == version:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.05)  # the ticker's poll
            latest = await sub.next()
            return first.snapshot_version, latest.snapshot_version, \
                pool.view.version, sub.skipped

    first, latest, current, skipped = asyncio.run_coroutine_threadsafe(
        slow_reader(6), svc.loop).result(timeout=20)
    assert latest == current > first  # the table after the pause is the newest one
    assert skipped >= 4  # ...and the ones in between were never queued for this reader


def test_changes_faster_than_min_interval_arrive_as_few_tables_ending_with_the_newest(
        fake_vllm, serve_weights):
    a, b = fake_vllm(vllm_page(waiting=0)), fake_vllm(vllm_page(waiting=0))
    svc = serve_weights([a.address, b.address], min_interval_ms=300)
    reader = Reader(svc)
    first = reader.next()
    for q in (1, 2, 3, 4):
        b.page = vllm_page(waiting=q)
        time.sleep(0.06)  # a new page every scrape or so: far faster than 300 ms
    time.sleep(0.8)
    got = []
    while not reader.tables.empty():
        got.append(reader.next())
    # ~1.0 s of changes at most one table per 300 ms, the last one on the newest page
    assert 1 <= len(got) <= 4
    assert got[-1].snapshot_version > first.snapshot_version
    assert row(got[-1], b.address).total < row(got[-1], a.address).total
    stamps = [first.timestamp_ms] + [t.timestamp_ms for t in got]
    assert all(later - earlier >= 290 for earlier, later in zip(stamps, stamps[1:]))
    reader.close()


def test_an_unknown_model_is_unavailable_like_pick(fake_vllm, serve_weights):
    a = fake_vllm(vllm_page(model="m"))
    svc = serve_weights([a.address])
    call = svc.picker.WatchWeights(pb.WeightsRequest(model="nope"), timeout=5)
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as pick:
        svc.picker.Pick(pb.PickRequest(model="nope"), timeout=5)
    assert pick.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == pick.value.details()


def test_a_bad_request_names_the_field(fake_vllm, serve_weights):
    a = fake_vllm(vllm_page())
    svc = serve_weights([a.address])
    for request, field in ((pb.WeightsRequest(), "WeightsRequest.model"),
                           (pb.WeightsRequest(model="m", adapter="a,b"),
                            "WeightsRequest.adapter"),
                           (pb.WeightsRequest(model="m", criticality=9),
                            "WeightsRequest.criticality")):
        with pytest.raises(grpc.RpcError) as info:
            next(svc.picker.WatchWeights(request, timeout=5))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in info.value.details()


def test_cancel_ends_the_stream_and_frees_the_subscription(fake_vllm, serve_weights):
    a = fake_vllm(vllm_page())
    svc = serve_weights([a.address])
    hub = svc.service.weights

    def tasks():
        return svc.call(lambda: len(asyncio.all_tasks(svc.loop)))

    before = tasks()
    readers = [Reader(svc) for _ in range(3)]
    for r in readers:
        r.next()
    assert svc.call(lambda: (hub.subscribers, hub.feeds)) == (3, 1)
    for r in readers:
        r.close()
    assert wait_for(lambda: svc.call(lambda: (hub.subscribers, hub.feeds)) == (0, 0))
    assert wait_for(lambda: tasks() <= before)


def test_weighing_leaves_no_trace_on_the_pick_path(fake_vllm, serve_weights):
    a, b = fake_vllm(vllm_page(waiting=0)), fake_vllm(vllm_page(waiting=3))
    svc = serve_weights([a.address, b.address],
                        policies=("load", "prefix-cache", "lora-affinity"))
    sched = svc.service.scheduler
    hub = svc.service.weights

    def state():
        return (sched.pending_decisions, sched.assignments.in_flight(a.address),
                sched.assignments.in_flight(b.address))

    before = svc.call(state)
    for crit in (abi.Criticality.STANDARD, abi.Criticality.CRITICAL):
        for _ in range(20):
            svc.call(hub.table, "m", "sql-lora", crit)
    assert svc.call(state) == before


def test_the_share_rules_sum_to_one_and_keep_the_order():
    import numpy as np

    from epick.api.weights import shares

    totals = np.array([2.6, 1.9, 1.8])
    for rule in ("softmax", "proportional"):
        s = shares(totals, rule, 0.1)
        assert s.sum() == pytest.approx(1.0) and s[0] > s[1] > s[2] > 0
    assert shares(totals, "softmax", 0.1)[0] > shares(totals, "proportional")[0]
    assert list(shares(np.zeros(4), "proportional")) == [0.25] * 4


def test_weights_config_defaults_and_a_bad_rule_named():
    from epick import config

    c = config.loads("version = 1")
    assert (c.weights.threshold, c.weights.min_interval_ms, c.weights.rule,
            c.weights.temperature) == (0.02, 500.0, "softmax", 0.1)
    with pytest.raises(config.ConfigError) as info:
        config.loads("version = 1\n[weights]\nrule = 'fair'", source="epick.toml")
    assert "$.weights.rule" in str(info.value)


def test_the_hub_answers_one_table_for_other_front_ends(fake_vllm, serve_weights):
    from epick.api.picker import InvalidArgument
    from epick.scheduler.scheduler import Unavailable

    a, b = fake_vllm(vllm_page(waiting=0)), fake_vllm(vllm_page(waiting=9))
    svc = serve_weights([a.address, b.address])
    hub = svc.service.weights
    table = svc.call(hub.table, "m")
    assert table.weights() == {a.address: pytest.approx(1.0), b.address: 0.0}
    assert [e.filtered_by for e in table.endpoints] == ["", "saturated"]
    with pytest.raises(InvalidArgument, match="WeightsRequest.model"):
        svc.call(hub.table, "")
    with pytest.raises(Unavailable):
        svc.call(hub.table, "other-model")
