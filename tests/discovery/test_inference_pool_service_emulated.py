"""`epick serve` with a `kind = "inference-pool"` source against the Kubernetes API
emulator (kmock), not a real cluster: pods made Ready are scraped and picked, pods
removed are never picked again, no restart. The "pods" are simulated replicas
(epick.sim) on loopback addresses, two target ports each (data-parallel ranks)."""

from __future__ import annotations

from dnsmasq import free_port
from epick_service import make_config, running
from fleet_thread import replicas
from kube_emulator import PODS, POOLS, emulator, pod, pool
from test_dns_service import MODEL, candidates, fresh, members, wait_for, with_sources

from epick.api.gen.epick.v1 import picker_pb2

VLLM = {"app": "vllm"}


def test_pods_made_ready_and_deleted_change_what_pick_uses(tmp_path):
    p1 = free_port("127.0.0.2")
    p2 = free_port("127.0.0.2")
    a = [f"127.0.0.2:{p1}", f"127.0.0.2:{p2}"]
    b = [f"127.0.0.3:{p1}", f"127.0.0.3:{p2}"]
    with replicas([("127.0.0.2", p1), ("127.0.0.2", p2), ("127.0.0.3", p1),
                   ("127.0.0.3", p2)]), emulator() as emu:
        emu.create(POOLS, pool("fleet", labels=VLLM, ports=[p1, p2]))
        emu.create(PODS, pod("vllm-a", labels=VLLM, ip="127.0.0.2", ready=True))
        emu.create(PODS, pod("vllm-b", labels=VLLM))
        source = {"kind": "inference-pool", "name": "fleet", "namespace": "default",
                  "api_server": emu.url, "template": {"labels": {"found-by": "k8s"}}}
        config = with_sources(make_config([], policies=("load",), tmp=tmp_path), [source])
        with running(config) as svc:
            wait_for(lambda: fresh(svc) == set(a), what="pod a's two ranks scraped")
            assert candidates(svc) == set(a)
            info = svc.call(lambda: svc.service.pool.view.info)
            assert {lbl for i in info for lbl in i.labels} == {("found-by", "k8s")}

            emu.set_ready("vllm-b", "127.0.0.3")
            wait_for(lambda: candidates(svc) == set(a + b), timeout=5, what="Pick sees b")

            emu.delete(PODS, "vllm-a")
            wait_for(lambda: members(svc) == set(b), timeout=5, what="a gone")
            picked = {svc.picker.Pick(picker_pb2.PickRequest(model=MODEL), timeout=5).endpoint
                      for _ in range(20)}
            assert picked <= set(b) and picked
