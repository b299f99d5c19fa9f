"""An explanation shows every configured endpoint: one whose metrics page fails is there,
named as not a candidate and why; the winner's rank 0 is in the JSON."""

from __future__ import annotations

import json
import time

from fakes import vllm_page
from google.protobuf.json_format import MessageToJson

from epick.api.gen.epick.v1 import picker_pb2 as pb


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_an_endpoint_whose_metrics_answer_404_is_explained_not_dropped(fake_vllm, serve):
    good, missing = fake_vllm(vllm_page(waiting=1)), fake_vllm(vllm_page())
    missing.status = 404
    svc = serve([good.address, missing.address], policies=("load",))
    assert wait_for(lambda: missing.hits >= 1)
    r = svc.picker.Pick(pb.PickRequest(model="m", explain=True, seed=1))
    rows = {c.endpoint: c for c in r.explanation.candidates}
    assert list(rows) == [good.address, missing.address]
    row = rows[missing.address]
    assert row.filtered_by == "no-metrics" and row.rank == -1
    assert row.reason.startswith(f"no good scrape of http://{missing.address}/metrics yet; "
                                 f"last error: http://{missing.address}/metrics: HTTP 404")
    # JSON (what grpcurl prints): the winner carries "rank": 0, not an absent field.
    as_json = json.loads(MessageToJson(r))["explanation"]["candidates"]
    assert as_json[0]["endpoint"] == good.address and as_json[0]["rank"] == 0
    assert as_json[1]["filteredBy"] == "no-metrics" and "HTTP 404" in as_json[1]["reason"]


def test_a_stale_endpoint_says_how_old_its_metrics_are_and_what_failed(fake_vllm, serve):
    a, b = fake_vllm(vllm_page()), fake_vllm(vllm_page())
    svc = serve([a.address, b.address], policies=("load",))
    b.status = 500
    time.sleep(0.6)  # stale_after_ms is 400 in these tests

    def stale_row():
        r = svc.picker.Pick(pb.PickRequest(model="m", explain=True))
        row = {c.endpoint: c for c in r.explanation.candidates}[b.address]
        return row if row.filtered_by == "fresh" else None

    assert wait_for(lambda: stale_row() is not None)
    reason = stale_row().reason
    assert reason.startswith(f"metrics are stale: the last good scrape of "
                             f"http://{b.address}/metrics was ")
    assert reason.endswith("HTTP 500 Internal Server Error")


def test_unavailable_because_every_metrics_page_fails_quotes_the_errors(fake_vllm, serve):
    import grpc
    import pytest

    missing = fake_vllm(vllm_page())
    missing.status = 404
    svc = serve([missing.address], policies=("load",))
    assert wait_for(lambda: missing.hits >= 1)
    with pytest.raises(grpc.RpcError) as info:
        svc.picker.Pick(pb.PickRequest(model="m"))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == (
        f"no endpoint has reported metrics yet (last scrape errors: {missing.address}: "
        f"http://{missing.address}/metrics: HTTP 404 Not Found)")
