"""Config reload without restart, refusal of a bad edit, and grpcurl via reflection alone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from epick_service import config_text, running
from fakes import vllm_page

from epick import config as cfg
from epick.api.gen.epick.v1 import picker_pb2 as pb

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or "grpcurl"


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def endpoints_of(svc):
    return svc.call(lambda: {e.address for e in svc.service.pool.view.snapshot.endpoints})


def test_editing_the_config_adds_and_removes_endpoints_without_restart(fake_vllm, tmp_path):
    a, b = fake_vllm(vllm_page(waiting=5)), fake_vllm(vllm_page(waiting=0))
    path = tmp_path / "epick.toml"
    path.write_text(config_text([a.address], tmp=tmp_path))
    with running(cfg.load(path), config_path=path) as svc:
        assert endpoints_of(svc) == {a.address}
        path.write_text(config_text([a.address, b.address], tmp=tmp_path))
        assert wait_for(lambda: endpoints_of(svc) == {a.address, b.address})
        r = svc.picker.Pick(pb.PickRequest(model="m", seed=1))
        assert r.endpoint == b.address
        path.write_text(config_text([b.address], tmp=tmp_path))
        assert wait_for(lambda: endpoints_of(svc) == {b.address})


def test_a_broken_config_edit_is_refused_and_the_old_one_keeps_serving(fake_vllm, tmp_path,
                                                                       caplog):
    a = fake_vllm(vllm_page())
    path = tmp_path / "epick.toml"
    path.write_text(config_text([a.address], tmp=tmp_path))
    with running(cfg.load(path), config_path=path) as svc:
        path.write_text(config_text([a.address], tmp=tmp_path) + "[admission]\nkv_threshold = 7\n")
        assert wait_for(lambda: "config reload refused" in caplog.text)
        assert "Expected `float` <= 1.0 - at `$.admission.kv_threshold`" in caplog.text
        assert svc.picker.Pick(pb.PickRequest(model="m")).endpoint == a.address
        # A module that does not exist is refused the same way.
        path.write_text(config_text([a.address], policies=("nope",), tmp=tmp_path))
        assert wait_for(lambda: "policy 'nope': cannot read module" in caplog.text)
        assert svc.call(lambda: svc.service.manager.names()) == ["load"]


def test_sighup_reloads_the_config_of_a_running_epick_serve(fake_vllm, tmp_path):
    a, b = fake_vllm(vllm_page(waiting=4)), fake_vllm(vllm_page(waiting=0))
    path = tmp_path / "epick.toml"
    path.write_text(config_text([a.address], tmp=tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "epick.cli", "serve", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        target = proc.stdout.readline().rsplit(" ", 1)[1].strip()
        with grpc.insecure_channel(target) as ch:
            from epick.api.gen.epick.v1 import picker_pb2_grpc

            stub = picker_pb2_grpc.EndpointPickerStub(ch)
            assert stub.Pick(pb.PickRequest(model="m")).endpoint == a.address
            # Rewrite the file atomically (rename), then signal: SIGHUP alone must reload.
            tmp = tmp_path / "new.toml"
            tmp.write_text(config_text([a.address, b.address], tmp=tmp_path))
            os.replace(tmp, path)
            proc.send_signal(signal.SIGHUP)
            assert wait_for(lambda: stub.Pick(pb.PickRequest(model="m")).endpoint == b.address)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_grpcurl_lists_and_calls_pick_with_reflection_alone(fake_vllm, serve):
    servers = [fake_vllm(vllm_page(waiting=q)) for q in (3, 0, 7)]
    svc = serve([s.address for s in servers], policies=("load",))
    listed = subprocess.run([GRPCURL, "-plaintext", svc.target, "list"], capture_output=True,
                            text=True, timeout=30)
    assert listed.returncode == 0, listed.stderr
    assert {"epick.v1.EndpointPicker", "grpc.health.v1.Health"} <= set(listed.stdout.split())
    called = subprocess.run(
        [GRPCURL, "-plaintext", "-d", '{"model": "m", "seed": 3}', svc.target,
         "epick.v1.EndpointPicker/Pick"], capture_output=True, text=True, timeout=30)
    assert called.returncode == 0, called.stderr
    assert json.loads(called.stdout)["endpoint"] == servers[1].address
    def health():
        r = subprocess.run([GRPCURL, "-plaintext", svc.target, "grpc.health.v1.Health/Check"],
                           capture_output=True, text=True, timeout=30)
        return json.loads(r.stdout) if r.returncode == 0 else None

    # A busy machine can leave a scrape late for a moment (NOT_SERVING): the point here is
    # that grpcurl reaches Health through reflection, so wait for SERVING.
    assert wait_for(lambda: health() == {"status": "SERVING"}, timeout=15)
    bad = subprocess.run([GRPCURL, "-plaintext", "-d", "{}", svc.target,
                          "epick.v1.EndpointPicker/Pick"], capture_output=True, text=True,
                         timeout=30)
    assert "InvalidArgument" in bad.stderr and "PickRequest.model is required" in bad.stderr
