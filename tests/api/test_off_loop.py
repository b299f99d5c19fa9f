"""Nothing blocking on the event loop: admin saves on a worker, a giant LoadPolicy refused
by gRPC before it is read, the start-up compiles off the loop and before SERVING."""

from __future__ import annotations

import asyncio
import threading

import anyio
import grpc
import msgspec
import pytest
from epick_service import TOKEN, make_config, running
from fakes import vllm_page
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epick.api.admin import MAX_REQUEST_BYTES
from epick.api.gen.epick.v1 import admin_pb2 as apb
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.config import resolve_module
from epick.policy_manager import MAX_MODULE_BYTES
from epick.service import Service

AUTH = (("authorization", f"Bearer {TOKEN}"),)
LOAD = resolve_module("load").read_bytes()


def with_admin(config, **admin):
    return msgspec.structs.replace(config, admin=msgspec.structs.replace(config.admin,
                                                                         **admin))


def test_the_admin_message_cap_is_the_module_cap_plus_a_little():
    assert MAX_MODULE_BYTES == 8 << 20
    assert MAX_MODULE_BYTES < MAX_REQUEST_BYTES <= MAX_MODULE_BYTES + (1 << 20)


def test_a_30_mib_load_policy_is_refused_by_grpc_and_picks_go_on(fake_vllm, tmp_path):
    c = make_config([fake_vllm(vllm_page()).address], policies=("load",), tmp=tmp_path)
    with running(c) as svc:
        with pytest.raises(grpc.RpcError) as info:
            svc.admin.LoadPolicy(apb.LoadPolicyRequest(name="big", wasm=b"\0" * (30 << 20)),
                                 metadata=AUTH, timeout=60)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(MAX_REQUEST_BYTES) in info.value.details()
        assert svc.picker.Pick(pb.PickRequest(model="m")).endpoint
        # A module at the cap's scale still arrives (and is judged by the runtime).
        with pytest.raises(grpc.RpcError) as info:
            svc.admin.LoadPolicy(apb.LoadPolicyRequest(name="junk", wasm=b"\0" * (1 << 20)),
                                 metadata=AUTH, timeout=60)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_picks_are_answered_while_a_load_policy_is_being_saved(fake_vllm, tmp_path):
    c = with_admin(make_config([fake_vllm(vllm_page()).address], policies=("load",),
                               tmp=tmp_path),
                   persist_dir=str(tmp_path / "saved"), require_conformance=False)
    with running(c) as svc:
        writing, release = threading.Event(), threading.Event()
        store = svc.service.store
        plain = store.write

        def slow_write(f, data):  # holds the save in progress until the test says so
            if data == LOAD:
                writing.set()
                assert release.wait(30), "the test never released the write"
            plain(f, data)

        store.write = slow_write
        answer: list[object] = []
        loader = threading.Thread(target=lambda: answer.append(svc.admin.LoadPolicy(
            apb.LoadPolicyRequest(name="load2", wasm=LOAD), metadata=AUTH, timeout=60)))
        loader.start()
        try:
            assert writing.wait(30), "the save never started"
            # The save is in progress, so a pick answered now was served beside it.
            assert svc.picker.Pick(pb.PickRequest(model="m"), timeout=10).endpoint
            assert not (tmp_path / "saved" / "load2.wasm").exists()
        finally:
            release.set()
            loader.join(timeout=60)
        assert [p.name for p in answer] == ["load2"]
        assert (tmp_path / "saved" / "load2.wasm").read_bytes() == LOAD


def test_serving_only_after_the_start_up_compiles_which_leave_the_loop_free(
        fake_vllm, tmp_path):
    c = make_config([fake_vllm(vllm_page()).address], policies=("load",), tmp=tmp_path)
    compiling, release, started = threading.Event(), threading.Event(), threading.Event()
    box: dict = {}

    async def main() -> None:
        service = Service(c)
        box["service"], box["loop"] = service, asyncio.get_running_loop()
        manager = service.manager
        prepare_all = manager.prepare_all

        def held(*args, **kw):  # the compile, held until the test has looked
            box["compile_thread"] = threading.current_thread()
            compiling.set()
            assert release.wait(30), "the test never released the compile"
            return prepare_all(*args, **kw)

        manager.prepare_all = held
        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            started.set()
            await box["stop"].wait()
            tg.cancel_scope.cancel()

    def serve() -> None:
        async def with_stop() -> None:
            box["stop"] = anyio.Event()
            await main()
        anyio.run(with_stop, backend="asyncio")

    thread = threading.Thread(target=serve, name="epick-service")
    thread.start()
    try:
        assert compiling.wait(30), "the start-up compile never began"
        loop, service = box["loop"], box["service"]
        assert box["compile_thread"] is not thread  # on a worker, not the loop's thread

        async def tick():
            return service._serving
        # The loop answers while the compile is held, and nothing says SERVING yet.
        assert asyncio.run_coroutine_threadsafe(tick(), loop).result(timeout=10) is not True
        assert not started.is_set() and not service.scheduler.policies
        release.set()
        assert started.wait(30)
        with grpc.insecure_channel(f"127.0.0.1:{service.port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for _ in range(200):
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                threading.Event().wait(0.05)
            assert status == health_pb2.HealthCheckResponse.SERVING
        assert [e.name for e in service.scheduler.policies.entries] == ["load"]
    finally:
        release.set()
        if "stop" in box and "loop" in box:
            box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_the_service_measures_its_loop_and_names_a_stall(fake_vllm, tmp_path, caplog):
    import logging
    import time

    from epick import telemetry

    caplog.set_level(logging.WARNING, logger="epick.loop")
    c = make_config([fake_vllm(vllm_page()).address], policies=("load",), tmp=tmp_path)
    stalls = telemetry.REGISTRY.get_sample_value("epick_event_loop_stalls_total") or 0
    with running(c) as svc:
        watch = svc.service.loop_watch
        assert watch.warn_s == 0.1  # [server] loop_stall_warn_ms's default

        async def export_everything_on_the_loop():
            watch.sampled.clear()  # a stall at start-up may have been sampled already
            deadline = time.monotonic() + 10
            while not watch.sampled.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)

        asyncio.run_coroutine_threadsafe(export_everything_on_the_loop(),
                                         svc.loop).result(timeout=30)
        assert svc.picker.Pick(pb.PickRequest(model="m")).endpoint  # the loop is back
        deadline = time.monotonic() + 10
        while ("in export_everything_on_the_loop" not in caplog.text
               and time.monotonic() < deadline):
            time.sleep(0.02)
    assert "in export_everything_on_the_loop" in caplog.text
    assert telemetry.REGISTRY.get_sample_value("epick_event_loop_stalls_total") >= stalls + 1
    assert telemetry.REGISTRY.get_sample_value("epick_event_loop_lag_seconds_bucket",
                                               {"le": "0.1"}) < telemetry.REGISTRY.get_sample_value(
        "epick_event_loop_lag_seconds_count")
