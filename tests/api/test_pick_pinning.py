"""PickRequest.pin_endpoint: forced when [server] allow_pinning is on, refused when off,
UNAVAILABLE (never replaced) when the pinned endpoint is not fresh."""

from __future__ import annotations

import time

import grpc
import msgspec
import pytest
from epick_service import make_config, running
from fakes import vllm_page

from epick.api.gen.epick.v1 import picker_pb2 as pb

MODEL = "m"  # the model the fake pages name (tests/fakes.py)


def config(addresses, tmp, *, allow):
    c = make_config(addresses, policies=("load",), tmp=tmp)
    return msgspec.structs.replace(c, server=msgspec.structs.replace(c.server,
                                                                      allow_pinning=allow))


def error_of(svc, **kw):
    with pytest.raises(grpc.RpcError) as info:
        svc.picker.Pick(pb.PickRequest(model=MODEL, **kw), timeout=5)
    return info.value.code(), info.value.details()


def test_pinning_off_is_invalid_argument_naming_the_setting(fake_vllm, tmp_path):
    servers = [fake_vllm(vllm_page()) for _ in range(2)]
    with running(config([s.address for s in servers], tmp_path, allow=False)) as svc:
        assert error_of(svc, pin_endpoint=servers[0].address) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"PickRequest.pin_endpoint '{servers[0].address}' is refused: pinning is off on "
            "this server (set [server] allow_pinning = true to allow it)")


def test_a_pinned_endpoint_is_picked_even_when_busy_and_sheddable(fake_vllm, tmp_path):
    busy = fake_vllm(vllm_page(waiting=50, kv=0.99))
    idle = fake_vllm(vllm_page())
    with running(config([busy.address, idle.address], tmp_path, allow=True)) as svc:
        for _ in range(5):
            r = svc.picker.Pick(pb.PickRequest(model=MODEL, pin_endpoint=busy.address,
                                               criticality=pb.SHEDDABLE), timeout=5)
            assert (r.endpoint, list(r.fallbacks)) == (busy.address, [])
        assert error_of(svc, pin_endpoint="no-port") == (
            grpc.StatusCode.INVALID_ARGUMENT, "PickRequest.pin_endpoint 'no-port' is not host:port")
        assert error_of(svc, pin_endpoint="10.9.9.9:1") == (
            grpc.StatusCode.UNAVAILABLE,
            "pinned endpoint '10.9.9.9:1' is not in the pool (or has never reported metrics)")


def test_a_pinned_endpoint_gone_stale_is_unavailable_not_replaced(fake_vllm, tmp_path):
    going = fake_vllm(vllm_page())
    staying = fake_vllm(vllm_page())
    with running(config([going.address, staying.address], tmp_path, allow=True)) as svc:
        assert svc.picker.Pick(pb.PickRequest(model=MODEL, pin_endpoint=going.address),
                               timeout=5).endpoint == going.address
        going.stop()
        deadline = time.monotonic() + 15
        while True:
            try:
                svc.picker.Pick(pb.PickRequest(model=MODEL, pin_endpoint=going.address),
                                timeout=5)
            except grpc.RpcError as exc:
                assert (exc.code(), exc.details()) == (
                    grpc.StatusCode.UNAVAILABLE,
                    f"pinned endpoint '{going.address}' is not fresh (its metrics are stale)")
                break
            assert time.monotonic() < deadline, "the stopped endpoint never went stale"
            time.sleep(0.05)
        # Unpinned requests still go to the endpoint that is left.
        assert svc.picker.Pick(pb.PickRequest(model=MODEL), timeout=5).endpoint == (
            staying.address)
