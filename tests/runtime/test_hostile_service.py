"""Hostile modules live in a serving epick: picks never fail and stay bounded, the
breakers and the off-path rebuilds do their job, and the policy folder cannot block
the service. (The latencies themselves: `epick bench sandbox-under-fire`.)"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import urllib.request

import grpc
import msgspec
import numpy as np
import pytest
from epick_service import TOKEN, config_text, make_config, running
from fakes import vllm_page
from hostile import HOSTILE, MODEL
from wat_modules import wasm

from epick import config as cfg
from epick.api.gen.epick.v1 import admin_pb2 as apb
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.gen.epick.v1 import picker_pb2_grpc
from epick.config import resolve_module

AUTH = (("authorization", f"Bearer {TOKEN}"),)
LOAD = resolve_module("load").read_bytes()


def ungated(c):
    return msgspec.structs.replace(c, admin=msgspec.structs.replace(
        c.admin, require_conformance=False))


def pick_for(svc, seconds: float, threads: int = 2) -> tuple[list[float], list[BaseException]]:
    """Pick from ``threads`` clients for ``seconds``; (latencies in s, failures)."""
    stop = threading.Event()
    lat: list[float] = []
    failures: list[BaseException] = []

    def client() -> None:
        with grpc.insecure_channel(svc.target) as ch:
            stub = picker_pb2_grpc.EndpointPickerStub(ch)
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    stub.Pick(pb.PickRequest(model=MODEL), timeout=30)
                    lat.append(time.perf_counter() - t0)
                except grpc.RpcError as exc:
                    failures.append(exc)

    workers = [threading.Thread(target=client) for _ in range(threads)]
    for w in workers:
        w.start()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join(timeout=60)
    return lat, failures


def info(svc, name):
    return {p.name: p for p in svc.admin.ListPolicies(apb.ListPoliciesRequest(),
                                                      metadata=AUTH).policies}[name]


@pytest.mark.parametrize("case", [c for c in HOSTILE if c != "benign"])
def test_a_hostile_module_costs_no_pick(fake_vllm, tmp_path, case):
    servers = [fake_vllm(vllm_page(waiting=k, model=MODEL)) for k in range(3)]
    c = ungated(make_config([s.address for s in servers], policies=("load",), tmp=tmp_path))
    with running(c) as svc:
        svc.admin.LoadPolicy(apb.LoadPolicyRequest(name="hostile", wasm=HOSTILE[case][1]),
                             metadata=AUTH)
        lat, failures = pick_for(svc, 1.2)
        listed = info(svc, "hostile")
        if case == "trap-every-other" and listed.breaker == "closed":
            # the last call was a half-open trial that succeeded: the next one traps
            svc.picker.Pick(pb.PickRequest(model=MODEL), timeout=30)
            listed = info(svc, "hostile")
        text = urllib.request.urlopen(
            f"http://127.0.0.1:{svc.service.metrics_port}/metrics", timeout=10).read().decode()
    assert failures == [] and len(lat) > 20
    # A liveness bound on a shared machine, not a latency goal (the bench measures it).
    assert float(np.percentile(lat, 99)) < 2.0
    if case in ("spin", "every-other", "hog"):
        assert "score=open" in listed.breakers or "score=half-open" in listed.breakers
    if case == "trap-every-other":
        # issue 32: kept out of picks by its dying instance, and ListPolicies and the
        # metrics say so (not "closed" beside "recovering")
        assert listed.breaker in ("open", "half-open")
        assert f"score={listed.breaker}" in listed.breakers
        assert 'epick_policy_breaker_open{policy="hostile",stage="score"} 1.0' in text
    if case == "trapping-hook":
        assert "pre_request=open" in listed.breakers and "score=closed" in listed.breakers
    if case in ("spin", "slow-start-trap", "hog", "trapping-hook", "trap-every-other"):
        assert listed.recoveries >= 1
    if case == "slow-start-trap":  # 1 in 3 fails: under the error rate; rebuilt off-path
        assert listed.recovering_skips >= 1
    else:
        assert listed.breaker_opens >= 1
    assert listed.smoke_fuel > 0
    assert 'epick_policy_recoveries_total{policy="hostile"}' in text
    assert 'epick_policy_breaker_opens_total{policy="hostile"}' in text


def test_a_fifo_in_the_policy_dir_is_refused_without_blocking(fake_vllm, tmp_path, caplog):
    c = make_config([fake_vllm(vllm_page()).address], policies=("load",), tmp=tmp_path)
    pdir = tmp_path / "policies"
    pdir.mkdir()
    c = msgspec.structs.replace(c, runtime=msgspec.structs.replace(c.runtime,
                                                                   policy_dir=str(pdir)))
    outside = tmp_path / "outside.wasm"
    outside.write_bytes(LOAD)
    with running(c) as svc:
        os.mkfifo(pdir / "fifo.wasm")
        (pdir / "link.wasm").symlink_to(outside)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (
                "fifo.wasm is not a regular file" in caplog.text
                and "link.wasm is a symlink" in caplog.text):
            assert svc.picker.Pick(pb.PickRequest(model="m"), timeout=5).endpoint
            time.sleep(0.05)
        assert "(a FIFO); not read" in caplog.text
        assert "only regular files are loaded from the policy folder" in caplog.text
        assert [p.name for p in svc.admin.ListPolicies(apb.ListPoliciesRequest(),
                                                       metadata=AUTH).policies] == ["load"]
        assert svc.picker.Pick(pb.PickRequest(model="m"), timeout=5).endpoint


def test_a_refused_module_leaves_nothing_cached_and_a_removed_one_is_freed(fake_vllm,
                                                                            tmp_path):
    c = ungated(make_config([fake_vllm(vllm_page()).address], policies=("load",),
                            tmp=tmp_path))
    with running(c) as svc:
        rt = svc.service.runtime
        before_mem, before_disk = rt.cached_modules, set((tmp_path / "cache").iterdir())
        nan = bytes(wasm("constant", value="nan", extra=0))  # compiles, fails the smoke run
        with pytest.raises(grpc.RpcError) as err:
            svc.admin.LoadPolicy(apb.LoadPolicyRequest(name="bad", wasm=nan), metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert rt.cached_modules == before_mem
        assert set((tmp_path / "cache").iterdir()) == before_disk
        svc.admin.LoadPolicy(apb.LoadPolicyRequest(name="extra", wasm=HOSTILE["benign"][1]),
                             metadata=AUTH)
        plugin = svc.call(lambda: svc.service.scheduler.policies.get("extra").plugin)
        sha = svc.call(lambda: svc.service.manager.active["extra"].module.sha256)
        assert sha in rt.cached_modules
        svc.admin.RemovePolicy(apb.RemovePolicyRequest(name="extra"), metadata=AUTH)
        assert svc.call(lambda: plugin.supervisor.instance) is None  # closed: its Store is gone
        assert sha not in rt.cached_modules


def test_a_config_reload_compiles_and_vets_off_the_event_loop(fake_vllm, tmp_path):
    a = fake_vllm(vllm_page())
    path = tmp_path / "epick.toml"
    path.write_text(config_text([a.address], tmp=tmp_path))
    with running(cfg.load(path), config_path=path) as svc:
        manager = svc.service.manager
        seen: list[str] = []
        real = manager.prepare_all

        def recording(entries, changed=None):
            seen.append(threading.current_thread().name)
            return real(entries, changed)

        manager.prepare_all = recording
        hostile = tmp_path / "hostile.wasm"
        hostile.write_bytes(HOSTILE["slow-start-trap"][1])  # a ~30+ ms init
        path.write_text(config_text([a.address], tmp=tmp_path)
                        + f'[[policies]]\nname = "slow"\nmodule = "{hostile}"\n')
        applied = asyncio.run_coroutine_threadsafe(svc.service.reload_async(),
                                                   svc.loop).result(timeout=60)
        assert applied and seen and "epick-service" not in seen
        assert svc.call(lambda: manager.names()) == ["load", "slow"]
