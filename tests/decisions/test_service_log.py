"""`epick serve` with [decisions] log: real gRPC picks and completions land in the log."""

from __future__ import annotations

import time

import msgspec
from epick_service import make_config, running
from fakes import vllm_page

from epick import config as cfg
from epick import telemetry
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.decisions import read_file, replay, schema

MODEL = "m"


def test_a_served_run_is_logged_and_replays_to_the_same_picks(tmp_path, fake_vllm, runtime):
    servers = [fake_vllm(vllm_page(waiting=q, running_adapters="sql", max_lora=2))
               for q in (3, 1, 0)]
    path = tmp_path / "logs" / "epick.declog"
    config = make_config([s.address for s in servers], tmp=tmp_path)
    config = msgspec.structs.replace(config, decisions=cfg.DecisionsConfig(log=str(path)))
    before = telemetry.REGISTRY.get_sample_value(
        "epick_decision_log_records_total", {"kind": "decision"}) or 0.0
    picked = []
    with running(config) as svc:
        for i in range(40):
            if i == 20:  # the pool changes mid-run: a second snapshot version
                first = svc.service.pool.view.version
                servers[2].page = vllm_page(waiting=9, running_adapters="sql", max_lora=2)
                # wait for the scrape (a busy machine may take long): the picks after it
                # must see the new version
                deadline = time.monotonic() + 30
                while (svc.service.pool.view.version == first
                       and time.monotonic() < deadline):
                    time.sleep(0.02)
            r = svc.picker.Pick(pb.PickRequest(
                model=MODEL, adapter="sql" if i % 2 else "", seed=i, explain=i % 3 == 0,
                prompt=f"[tenant {i % 4}] " + "shared system prompt " * 20 + f"q{i}"),
                timeout=5)
            picked.append(r.endpoint)
            if i % 4:
                svc.picker.ReportCompletion(pb.CompletionReport(
                    decision_id=r.decision_id, endpoint=r.endpoint, status=pb.OK,
                    prompt_tokens=100 + i, completion_tokens=7, ttft_seconds=0.25), timeout=5)
    records = list(read_file(path))
    decisions = [x for x in records if isinstance(x, schema.DecisionRec)]
    completions = [x for x in records if isinstance(x, schema.CompletionRec)]
    assert len(decisions) == 40 and len(completions) == 30
    assert completions[0].prompt_tokens == 101 and completions[0].completion_tokens == 7
    assert completions[0].ttft_s == 0.25
    header = records[0]
    assert isinstance(header, schema.Header) and header.fresh_start
    assert sum(isinstance(x, schema.Module) for x in records) == 3
    snapshots = [x for x in records if isinstance(x, schema.SnapshotRec)]
    assert len({s.version for s in snapshots}) == len(snapshots) >= 2
    assert telemetry.REGISTRY.get_sample_value(
        "epick_decision_log_records_total", {"kind": "decision"}) - before == 40

    r = replay([path], runtime=runtime)
    assert r.decisions == 40 and r.agreement == 1.0 and r.fallbacks_agreed == 40
    assert sum(a for a, _ in r.spread.values()) == 40
    assert r.unknown_completions == 0
