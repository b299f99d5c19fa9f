"""epick serve end to end: real gRPC, real scraped /metrics pages, real WASM policies."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from fakes import vllm_page
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.picker import InvalidArgument, to_request


def wait_for(predicate, timeout=5.0, step=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


def pick(svc, **kw):
    kw.setdefault("model", "m")
    return svc.picker.Pick(pb.PickRequest(**kw), timeout=5)


def code_of(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


def test_queue_10_5_0_sends_the_request_to_the_idle_endpoint(fake_vllm, serve):
    servers = [fake_vllm(vllm_page(waiting=q)) for q in (10, 5, 0)]
    svc = serve([s.address for s in servers], policies=("load",))
    r = pick(svc, seed=1)
    assert r.endpoint == servers[2].address
    assert list(r.fallbacks) == [servers[1].address, servers[0].address]
    assert r.decision_id


def test_an_adapter_running_on_one_endpoint_goes_there(fake_vllm, serve):
    servers = [fake_vllm(vllm_page(running_adapters=a, max_lora=1))
               for a in ("x", "sql-lora", "y")]
    svc = serve([s.address for s in servers])
    for seed in range(5):
        assert pick(svc, adapter="sql-lora", seed=seed).endpoint == servers[1].address


def test_sheddable_is_resource_exhausted_when_every_endpoint_is_over_thresholds(fake_vllm, serve):
    servers = [fake_vllm(vllm_page(waiting=6)), fake_vllm(vllm_page(kv=0.9))]
    svc = serve([s.address for s in servers])
    code, details = code_of(lambda: pick(svc, criticality=pb.SHEDDABLE))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "SHEDDABLE request shed" in details
    assert pick(svc, criticality=pb.CRITICAL).endpoint in {s.address for s in servers}


def test_a_garbage_page_drops_the_endpoint_after_stale_after_and_service_still_answers(
        fake_vllm, serve):
    good, bad = fake_vllm(vllm_page(waiting=9)), fake_vllm(vllm_page(waiting=0))
    svc = serve([good.address, bad.address], policies=("load",))
    assert pick(svc, seed=1).endpoint == bad.address
    bad.page = "this is {not prometheus"
    assert wait_for(lambda: pick(svc, seed=2).endpoint == good.address, timeout=3)
    assert all(pick(svc, seed=k).endpoint == good.address for k in range(10))


def test_a_killed_metrics_server_drops_the_endpoint_and_others_keep_serving(fake_vllm, serve):
    a, b = fake_vllm(vllm_page(waiting=9)), fake_vllm(vllm_page(waiting=0))
    svc = serve([a.address, b.address], policies=("load",))
    assert pick(svc, seed=1).endpoint == b.address
    b.stop()
    assert wait_for(lambda: pick(svc, seed=2).endpoint == a.address, timeout=3)
    r = pick(svc, seed=3, explain=True)
    rows = {c.endpoint: c for c in r.explanation.candidates}
    assert rows[b.address].filtered_by == "fresh"


def test_no_fresh_endpoint_is_unavailable_and_health_goes_not_serving(fake_vllm, serve):
    a = fake_vllm(vllm_page())
    svc = serve([a.address], policies=("load",))
    health = health_pb2_grpc.HealthStub(svc.channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == \
        health_pb2.HealthCheckResponse.SERVING
    a.stop()
    assert wait_for(lambda: health.Check(health_pb2.HealthCheckRequest()).status ==
                    health_pb2.HealthCheckResponse.NOT_SERVING, timeout=3)
    code, details = code_of(lambda: pick(svc))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert details.startswith("no endpoint has fresh metrics (all stale) (last scrape "
                              f"errors: {a.address}: http://{a.address}/metrics: ")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"model": ""}, "PickRequest.model is required"),
        ({"model": "a,b"}, "PickRequest.model 'a,b' contains a comma"),
        ({"adapter": "x" * 300}, "PickRequest.adapter is 300 characters long; the limit is 256"),
        ({"adapter": " sql"}, "PickRequest.adapter ' sql' has leading or trailing whitespace"),
        ({"criticality": 9}, "PickRequest.criticality 9 is not one of CRITICAL (1), STANDARD "
                             "(2), SHEDDABLE (3)"),
        ({"request_id": "r" * 257}, "PickRequest.request_id is 257 characters long"),
        ({"cache_salt": "s" * 257}, "PickRequest.cache_salt is 257 characters long"),
        # one byte over 4 MiB (the old case wrote 4 << 20 + 1, which is 8 MiB)
        ({"prompt": "p" * ((4 << 20) + 1)},
         "PickRequest.prompt is 4194305 bytes; the limit is 4194304"),
        # counted in UTF-8 bytes, not characters: 2 MiB + 1 two-byte characters
        ({"prompt": "é" * ((2 << 20) + 1)},
         "PickRequest.prompt is 4194306 bytes; the limit is 4194304"),
        ({"headers": {f"h{i}": "v" for i in range(200)}},
         "PickRequest.headers has 200 entries; the limit is 128"),
        ({"model": "m\x00x"}, "PickRequest.model 'm\\x00x' contains control characters"),
        ({"cache_salt": "a\x00b"}, "PickRequest.cache_salt contains a NUL character"),
    ],
    ids=["no-model", "comma", "long-adapter", "whitespace", "criticality", "long-id",
         "long-salt", "prompt-one-byte-over", "prompt-counted-in-bytes", "many-headers",
         "control-char", "nul-salt"],
)
def test_malformed_requests_are_refused_naming_the_field(fields, message):
    # the validation is a pure function: tested at its seam, no service booted per case
    with pytest.raises(InvalidArgument) as err:
        to_request(pb.PickRequest(**{"model": "m", **fields}))
    assert message in str(err.value)


@pytest.mark.parametrize("prompt", ["p" * (4 << 20), "é" * (2 << 20)],
                         ids=["ascii", "two-byte"])
def test_a_prompt_of_exactly_4_mib_is_accepted(prompt):
    assert to_request(pb.PickRequest(model="m", prompt=prompt)).prompt == prompt


def test_a_malformed_request_is_invalid_argument_over_grpc(fake_vllm, serve):
    svc = serve([fake_vllm(vllm_page()).address], policies=("load",))
    code, details = code_of(lambda: pick(svc, prompt="p" * ((4 << 20) + 1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "PickRequest.prompt is 4194305 bytes; the limit is 4194304"
    assert pick(svc, prompt="p" * (4 << 20)).endpoint  # the boundary itself is served


def test_report_completion_acknowledges_known_and_unknown_ids(fake_vllm, serve):
    svc = serve([fake_vllm(vllm_page(max_lora=2, running_adapters="")).address])
    r = pick(svc, adapter="a", request_id="req-1")
    ack = svc.picker.ReportCompletion(pb.CompletionReport(decision_id=r.decision_id,
                                                         endpoint=r.endpoint))
    assert ack.known is True
    again = svc.picker.ReportCompletion(pb.CompletionReport(decision_id=r.decision_id))
    assert again.known is False
    assert svc.picker.ReportCompletion(pb.CompletionReport(request_id="never")).known is False
    code, details = code_of(lambda: svc.picker.ReportCompletion(pb.CompletionReport()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "CompletionReport needs decision_id or request_id; both are empty"
    code, details = code_of(lambda: svc.picker.ReportCompletion(
        pb.CompletionReport(request_id="x", status=7)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "status 7" in details
    assert svc.call(lambda: svc.service.scheduler.pending_decisions) == 0


def test_explain_gives_every_candidate_its_per_policy_scores(fake_vllm, serve):
    servers = [fake_vllm(vllm_page(waiting=q, kv=kv)) for q, kv in ((10, 0.8), (0, 0.0))]
    svc = serve([s.address for s in servers], policies=("load",))
    r = pick(svc, explain=True, seed=4)
    rows = {c.endpoint: c for c in r.explanation.candidates}
    assert rows[servers[1].address].scores["load"] == pytest.approx(1.0)
    # queue 0, kv 1 - 0.8, work 8 / (8 + 10): (0 + 0.2 + 2 * 8/18) / 4
    assert rows[servers[0].address].scores["load"] == pytest.approx((0.2 + 2 * 8 / 18) / 4)
    assert rows[servers[1].address].rank == 0 and rows[servers[0].address].rank == 1
    assert r.explanation.snapshot_version >= 1
    assert rows[servers[1].address].in_flight == 0  # as the policies saw it: before this pick
    again = {c.endpoint: c for c in pick(svc, explain=True, seed=5).explanation.candidates}
    assert again[servers[1].address].in_flight == 1
    assert again[servers[0].address].in_flight == 0


def test_prometheus_metrics_count_picks_by_outcome(fake_vllm, serve):
    svc = serve([fake_vllm(vllm_page()).address], policies=("load",))
    pick(svc)
    code_of(lambda: pick(svc, model=""))
    url = f"http://127.0.0.1:{svc.service.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    assert 'epick_picks_total{outcome="ok"}' in text
    assert 'epick_picks_total{outcome="invalid"}' in text
    for stage in ("total", "filter", "score", "pick", "hooks"):
        assert f'stage="{stage}"' in text
