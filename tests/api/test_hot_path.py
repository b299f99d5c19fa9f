"""The per-pick path stays lean: telemetry children are bound once, not looked up per pick."""

from __future__ import annotations

import prometheus_client.metrics
from epick_service import TOKEN
from fakes import vllm_page

from epick.api.gen.epick.v1 import admin_pb2 as apb
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.config import resolve_module

AUTH = (("authorization", f"Bearer {TOKEN}"),)
# Metrics a pick records into; scrape errors and policy errors are not per pick.
PER_PICK = {"epick_pick_latency_seconds", "epick_picks", "epick_policy_score_latency_seconds",
            "epick_shadow_agreement", "epick_shadow_score_delta"}


def test_warm_unary_and_stream_picks_with_a_shadow_look_up_no_labels(
        fake_vllm, serve, monkeypatch):
    servers = [fake_vllm(vllm_page(waiting=0, running_adapters="b", max_lora=1)),
               fake_vllm(vllm_page(waiting=9, running_adapters="a", max_lora=1))]
    svc = serve([s.address for s in servers], policies=("load", "prefix-cache"))
    svc.admin.LoadPolicy(apb.LoadPolicyRequest(
        name="lora", wasm=resolve_module("lora-affinity").read_bytes(), shadow=True),
        metadata=AUTH)

    def picks(n: int, seed0: int) -> None:
        for k in range(n):
            request = pb.PickRequest(model="m", adapter="a", prompt="p" * 200, seed=seed0 + k)
            assert svc.picker.Pick(request, timeout=5).endpoint == servers[0].address
        answers = svc.picker.PickStream(
            iter(pb.PickStreamRequest(id=k, pick=pb.PickRequest(model="m", seed=k))
                 for k in range(n)), timeout=30)
        assert [a.WhichOneof("kind") for a in answers] == ["pick"] * n

    picks(3, 0)  # the shadow disagrees on the first pick only (test_admin): both labels seen
    looked_up = []
    real = prometheus_client.metrics.MetricWrapperBase.labels

    def counting(self, *values, **kw):
        looked_up.append(self._name)
        return real(self, *values, **kw)

    monkeypatch.setattr(prometheus_client.metrics.MetricWrapperBase, "labels", counting)
    picks(30, 100)
    assert [name for name in looked_up if name in PER_PICK] == []
