"""The admin API: auth, loading, weights, removal, shadow mode, the conformance gate,
and hot swap under load."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import msgspec
import pytest
from epick_service import TOKEN, make_config, running
from fakes import vllm_page

from epick.api.gen.epick.v1 import admin_pb2 as apb
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.gen.epick.v1 import picker_pb2_grpc
from epick.api.status import grpc_code
from epick.config import resolve_module
from epick.interfaces import STATUS, FailureKind

AUTH = (("authorization", f"Bearer {TOKEN}"),)
LOAD = resolve_module("load").read_bytes()
LORA = resolve_module("lora-affinity").read_bytes()


def code_of(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


def names(svc):
    return [p.name for p in svc.admin.ListPolicies(apb.ListPoliciesRequest(), metadata=AUTH)
            .policies]


def test_calls_without_a_token_are_unauthenticated(fake_vllm, serve):
    svc = serve([fake_vllm(vllm_page()).address], policies=("load",))
    code, details = code_of(lambda: svc.admin.ListPolicies(apb.ListPoliciesRequest()))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert details == "missing 'authorization: Bearer TOKEN' metadata"


@pytest.mark.parametrize("header, code, message", [
    ("Bearer wrong", grpc.StatusCode.PERMISSION_DENIED, "wrong admin token"),
    ("bearer  wrong ", grpc.StatusCode.PERMISSION_DENIED, "wrong admin token"),
    ("Basic s3cret", grpc.StatusCode.UNAUTHENTICATED,
     "the authorization metadata must be 'Bearer TOKEN'; got the Basic scheme: send "
     "'Bearer TOKEN' instead"),
    ("Bearer", grpc.StatusCode.UNAUTHENTICATED,
     "'authorization: Bearer' carries no token after 'Bearer '"),
    # The token without its scheme is the common slip: say so, and never echo it back.
    ("s3cret", grpc.StatusCode.UNAUTHENTICATED,
     "the authorization metadata must be 'Bearer TOKEN'; got a bare value with no scheme: "
     "prefix the token with 'Bearer '"),
    ("s3cret extra", grpc.StatusCode.UNAUTHENTICATED,
     "the authorization metadata must be 'Bearer TOKEN'; got a value that does not start "
     "with 'Bearer ': prefix the token with 'Bearer '"),
])
def test_a_wrong_or_malformed_token_is_refused_for_every_call_and_says_why(
        fake_vllm, serve, header, code, message):
    svc = serve([fake_vllm(vllm_page()).address], policies=("load",))
    md = (("authorization", header),)
    calls = [
        lambda: svc.admin.ListPolicies(apb.ListPoliciesRequest(), metadata=md),
        lambda: svc.admin.LoadPolicy(apb.LoadPolicyRequest(name="x", wasm=LOAD), metadata=md),
        lambda: svc.admin.RemovePolicy(apb.RemovePolicyRequest(name="load"), metadata=md),
        lambda: svc.admin.SetWeight(apb.SetWeightRequest(name="load", weight=3), metadata=md),
    ]
    for call in calls:
        got_code, details = code_of(call)
        assert (got_code, details) == (code, message)
        assert "s3cret" not in details
    assert names(svc) == ["load"]


def test_with_no_token_configured_the_admin_api_refuses_everything(fake_vllm, tmp_path):
    c = make_config([fake_vllm(vllm_page()).address], policies=("load",), tmp=tmp_path)
    c = msgspec.structs.replace(c, admin=msgspec.structs.replace(c.admin, token=""))
    with running(c) as svc:
        code, details = code_of(lambda: svc.admin.ListPolicies(apb.ListPoliciesRequest(),
                                                               metadata=AUTH))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "admin API has no token configured" in details


def test_list_policies_reports_identity_weight_and_call_stats(fake_vllm, serve):
    svc = serve([fake_vllm(vllm_page()).address])
    for k in range(20):
        svc.picker.Pick(pb.PickRequest(model="m", prompt="x" * 200, seed=k))
    listed = {p.name: p for p in svc.admin.ListPolicies(apb.ListPoliciesRequest(),
                                                         metadata=AUTH).policies}
    assert list(listed) == ["load", "prefix-cache", "lora-affinity"]
    load = listed["load"]
    assert load.kind == "load" and len(load.sha256) == 64 and load.weight == 1.0
    assert load.calls >= 20 and load.errors == 0 and 0 < load.p50_us <= load.p99_us
    assert load.breaker == "closed" and not load.shadow


def test_load_set_weight_and_remove_a_policy(fake_vllm, serve):
    svc = serve([fake_vllm(vllm_page()).address], policies=("load",))
    info = svc.admin.LoadPolicy(apb.LoadPolicyRequest(name="lora", wasm=LORA, weight=2.5,
                                                      params_json='{"profile": "upstream"}'),
                                metadata=AUTH)
    assert info.name == "lora" and info.weight == 2.5 and info.kind == "lora-affinity"
    assert names(svc) == ["load", "lora"]
    assert svc.admin.SetWeight(apb.SetWeightRequest(name="lora", weight=0.5),
                               metadata=AUTH).weight == 0.5
    svc.admin.RemovePolicy(apb.RemovePolicyRequest(name="lora"), metadata=AUTH)
    assert names(svc) == ["load"]
    code, details = code_of(lambda: svc.admin.RemovePolicy(apb.RemovePolicyRequest(name="lora"),
                                                           metadata=AUTH))
    assert code == grpc.StatusCode.NOT_FOUND and details == "no policy named 'lora'"


@pytest.mark.parametrize("request_kw, code, message", [
    ({"name": "x", "wasm": b"\x00asm garbage"}, grpc.StatusCode.FAILED_PRECONDITION,
     "policy 'x' rejected"),
    ({"name": "x", "wasm": b""}, grpc.StatusCode.INVALID_ARGUMENT, "LoadPolicy.wasm is empty"),
    ({"name": "", "wasm": LOAD}, grpc.StatusCode.INVALID_ARGUMENT, "LoadPolicy.name is required"),
    ({"name": "x", "wasm": LOAD, "params_json": "{nope"}, grpc.StatusCode.INVALID_ARGUMENT,
     "LoadPolicy.params_json is not JSON"),
    ({"name": "x", "wasm": LOAD, "params_json": "[1]"}, grpc.StatusCode.INVALID_ARGUMENT,
     "LoadPolicy.params_json must be a JSON object, got list"),
    ({"name": "x", "wasm": LOAD, "params_json": '{"queue_weight": "heavy"}'},
     grpc.StatusCode.FAILED_PRECONDITION, "queue_weight"),
    # A bad argument, whichever call carries it (SetWeight says the same).
    ({"name": "x", "wasm": LOAD, "weight": -1}, grpc.StatusCode.INVALID_ARGUMENT,
     "weight must be a finite number >= 0, got -1.0"),
], ids=["not-wasm", "empty", "no-name", "bad-json", "json-list", "bad-param", "neg-weight"])
def test_bad_loads_are_refused_with_a_reason_and_change_nothing(fake_vllm, serve, request_kw,
                                                                code, message):
    svc = serve([fake_vllm(vllm_page()).address], policies=("load",))
    got, details = code_of(lambda: svc.admin.LoadPolicy(apb.LoadPolicyRequest(**request_kw),
                                                        metadata=AUTH))
    assert got == code and message in details
    assert names(svc) == ["load"]
    assert svc.picker.Pick(pb.PickRequest(model="m")).endpoint


def test_a_module_failing_conformance_is_refused_but_may_shadow_when_allowed(
        fake_vllm, tmp_path, monkeypatch):
    # The lora-affinity module checked as a *load* policy fails the load vectors: a
    # stand-in for a module whose scores are wrong for the kind it claims.
    import epick.conformance as conformance

    real_check = conformance.check
    monkeypatch.setattr(conformance, "check",
                        lambda module, params, kind=None: real_check(module, params, kind="load"))
    c = make_config([fake_vllm(vllm_page()).address], policies=("load",), tmp=tmp_path)
    c = msgspec.structs.replace(c, admin=msgspec.structs.replace(
        c.admin, allow_nonconformant_shadow=True))
    with running(c) as svc:
        code, details = code_of(lambda: svc.admin.LoadPolicy(
            apb.LoadPolicyRequest(name="liar", wasm=LORA), metadata=AUTH))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "policy 'liar' rejected: fails conformance" in details
        assert "load/" in details  # names the failing vector
        assert names(svc) == ["load"]
        info = svc.admin.LoadPolicy(apb.LoadPolicyRequest(name="liar", wasm=LORA, shadow=True),
                                    metadata=AUTH)
        assert info.shadow
        assert svc.call(lambda: svc.service.manager.active["liar"].conformant) is False


def test_shadow_policy_scores_every_pick_without_changing_it(fake_vllm, serve):
    servers = [fake_vllm(vllm_page(waiting=0, running_adapters="b", max_lora=1)),
               fake_vllm(vllm_page(waiting=9, running_adapters="a", max_lora=1))]
    svc = serve([s.address for s in servers], policies=("load",))
    svc.admin.LoadPolicy(apb.LoadPolicyRequest(name="lora", wasm=LORA, shadow=True, weight=10),
                         metadata=AUTH)
    for k in range(10):
        assert svc.picker.Pick(pb.PickRequest(model="m", adapter="a", seed=k)).endpoint == \
            servers[0].address
    lora = {p.name: p for p in svc.admin.ListPolicies(apb.ListPoliciesRequest(),
                                                       metadata=AUTH).policies}["lora"]
    # Only the first pick disagrees: from then on the shadow's own request history (its
    # pre_request hook records the live picks too) has adapter a on the picked endpoint.
    assert lora.shadow and lora.calls >= 10
    assert lora.shadow_agreement == pytest.approx(0.9)
    text = urllib.request.urlopen(
        f"http://127.0.0.1:{svc.service.metrics_port}/metrics", timeout=5).read().decode()
    assert 'epick_shadow_agreement_total{agree="false",policy="lora"}' in text


def test_hot_swap_under_load_loses_no_pick_and_takes_effect(fake_vllm, tmp_path):
    # Endpoint A has the shorter queue, B the emptier KV cache: which one wins tells
    # which of the two load parametrisations is live.
    a = fake_vllm(vllm_page(waiting=0, kv=0.9))
    b = fake_vllm(vllm_page(waiting=8, kv=0.0))
    c = make_config([a.address, b.address], policies=("load",), tmp=tmp_path)
    c = msgspec.structs.replace(c, admin=msgspec.structs.replace(c.admin,
                                                                 require_conformance=False))
    queue_only = {"queue_weight": 1.0, "kv_weight": 0.0}
    kv_only = {"queue_weight": 0.0, "kv_weight": 1.0}
    with running(c) as svc:
        stop = threading.Event()
        failures: list[BaseException] = []
        picks = [0]

        def picker() -> None:
            with grpc.insecure_channel(svc.target) as ch:
                stub = picker_pb2_grpc.EndpointPickerStub(ch)
                while not stop.is_set():
                    try:
                        stub.Pick(pb.PickRequest(model="m"), timeout=10)
                        picks[0] += 1
                    except grpc.RpcError as exc:
                        failures.append(exc)

        threads = [threading.Thread(target=picker) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            mgr = svc.service.manager
            swaps = 0
            for k in range(1000):
                params = queue_only if k % 2 == 0 else kv_only
                svc.call(lambda p=params: mgr.activate("load", LOAD, p, source="test",
                                                       gate=False))
                swaps += 1
                if k % 100 == 0:
                    want = a.address if params is queue_only else b.address
                    assert svc.picker.Pick(pb.PickRequest(model="m")).endpoint == want
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        assert swaps == 1000 and failures == [] and picks[0] > 100
        svc.call(lambda: mgr.activate("load", LOAD, queue_only, gate=False))
        assert svc.picker.Pick(pb.PickRequest(model="m")).endpoint == a.address
        svc.call(lambda: mgr.activate("load", LOAD, kv_only, gate=False))
        assert svc.picker.Pick(pb.PickRequest(model="m")).endpoint == b.address


def test_a_wasm_dropped_into_the_policy_dir_is_hot_swapped_and_a_broken_one_refused(
        fake_vllm, tmp_path, caplog):
    a = fake_vllm(vllm_page(waiting=0, kv=0.9))
    b = fake_vllm(vllm_page(waiting=8, kv=0.0))
    c = make_config([a.address, b.address], policies=(), tmp=tmp_path)
    pdir = tmp_path / "policies"
    c = msgspec.structs.replace(c, runtime=msgspec.structs.replace(c.runtime,
                                                                   policy_dir=str(pdir)))
    with running(c) as svc:
        (pdir / "load.wasm").write_bytes(LOAD)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "load" not in names(svc):
            time.sleep(0.05)
        assert names(svc) == ["load"]
        assert svc.picker.Pick(pb.PickRequest(model="m", seed=1)).endpoint == a.address
        (pdir / "load.wasm").write_bytes(b"garbage")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "hot swap refused" not in caplog.text:
            time.sleep(0.05)
        assert "hot swap refused, the running policy stays: policy 'load' rejected" in caplog.text
        assert names(svc) == ["load"]
        assert svc.picker.Pick(pb.PickRequest(model="m", seed=1)).endpoint == a.address


@pytest.mark.parametrize("name", ["a\nb", "x" * 10_000, "\x1b[31mred", "../../etc/passwd",
                                  ".hidden", "a b"],
                         ids=["newline", "10k", "ansi", "traversal", "dot-first", "space"])
def test_load_policy_names_must_match_the_config_pattern(fake_vllm, serve, name):
    svc = serve([fake_vllm(vllm_page()).address], policies=("load",))
    code, details = code_of(lambda: svc.admin.LoadPolicy(
        apb.LoadPolicyRequest(name=name, wasm=LOAD), metadata=AUTH))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("LoadPolicy.name: name ")
    assert "must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$" in details
    assert "\n" not in details and "\x1b" not in details and len(details) < 400
    assert names(svc) == ["load"]


def test_concurrent_loads_beyond_the_queue_are_refused_with_a_clear_status(fake_vllm, serve):
    svc = serve([fake_vllm(vllm_page()).address], policies=("load",))
    outcomes: list[object] = []

    def load(k: int) -> None:
        try:
            svc.admin.LoadPolicy(apb.LoadPolicyRequest(name=f"p{k}", wasm=LORA),
                                 metadata=AUTH, timeout=120)
            outcomes.append("ok")
        except grpc.RpcError as exc:
            outcomes.append((exc.code(), exc.details()))

    threads = [threading.Thread(target=load, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        assert svc.picker.Pick(pb.PickRequest(model="m"), timeout=10).endpoint
        time.sleep(0.01)
    refused = [o for o in outcomes if o != "ok"]
    assert outcomes.count("ok") >= 1 and refused
    for code, details in refused:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "loads are already being vetted or waiting (at most 5); try again" in details
    assert len(names(svc)) == 1 + outcomes.count("ok")


@pytest.mark.parametrize("request_kw, kind", [
    ({"wasm": b"\x00asm garbage"}, FailureKind.INVALID_MODULE),
    ({"wasm": b"\x00" * 4096}, FailureKind.INVALID_MODULE),
    ({"wasm": LOAD, "params_json": '{"queue_weight": "heavy"}'}, FailureKind.INVALID_MODULE),
    ({"wasm": LOAD, "weight": -1}, FailureKind.BAD_ARGUMENT),
], ids=["garbage", "zeros", "init-refuses-params", "negative-weight"])
def test_a_refused_load_gets_the_status_the_table_says(fake_vllm, serve, request_kw, kind):
    svc = serve([fake_vllm(vllm_page()).address], policies=("load",))
    code, details = code_of(lambda: svc.admin.LoadPolicy(
        apb.LoadPolicyRequest(name="broken", **request_kw), metadata=AUTH))
    assert code == grpc.StatusCode[STATUS[kind].grpc] == grpc_code(kind)
    assert details.startswith("policy 'broken' rejected: ")
    assert names(svc) == ["load"]
