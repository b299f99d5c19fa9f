"""`[ext_proc] conformance_hooks`: the upstream Gateway conformance suite's test header
(`test-epp-endpoint-selection`) restricts the pick, and the response echoes the served
endpoint (`x-conformance-test-served-endpoint`) as the suite's reference picker does.
Off by default: the header is then ignored."""

from __future__ import annotations

import pytest
from fakes import vllm_page
from test_ext_proc_protocol import (
    DROPPED,
    body_msg,
    converse,
    destination,
    duplex_headers,
    headers_msg,
    immediate_of,
    response_headers_msg,
    set_headers,
)

SELECT = "test-epp-endpoint-selection"
SERVED = "x-conformance-test-served-endpoint"
SELECTED = "x-conformance-test-selected-endpoint"


@pytest.fixture
def pool(replicas):
    return [r.address for r in replicas(3, vllm_page())]


@pytest.fixture(params=["buffered", "duplex"])
def mode(request):
    return request.param


def route(svc, mode, value=None, *, then=()):
    make = duplex_headers if mode == "duplex" else headers_msg
    extra = [(SELECT, value)] if value is not None else []
    return converse(svc, [make(extra=extra), body_msg({"model": "base"}), *then])


def test_the_header_restricts_the_pick_to_the_listed_endpoints(epick, pool, mode):
    svc = epick(pool, conformance_hooks=True)
    for target in pool:
        for _ in range(3):
            assert destination(route(svc, mode, target), mode) == target
    two = f" {pool[0]} ,{pool[2]}"
    assert {destination(route(svc, mode, two), mode) for _ in range(12)} <= {pool[0], pool[2]}
    # A bare IP: any endpoint on it (here all three share 127.0.0.1).
    assert destination(route(svc, mode, "127.0.0.1"), mode) in pool


def test_an_ip_that_is_no_endpoint_is_a_429_as_upstreams_picker_answers(epick, pool, mode):
    svc = epick(pool, conformance_hooks=True)
    out = route(svc, mode, "256.256.256.256")
    status, body, headers = immediate_of(out[-1])
    assert status == 429
    assert "no endpoint in the subset hint [256.256.256.256]" in body["error"]["message"]
    assert headers[DROPPED] == "rejected-saturated"


def test_the_header_replaces_the_data_planes_subset_hint(epick, pool):
    svc = epick(pool, conformance_hooks=True)
    msgs = [headers_msg(extra=[(SELECT, pool[1])], subset=[pool[0]]),
            body_msg({"model": "base"})]
    assert destination(converse(svc, msgs), "buffered") == pool[1]


def test_the_response_echoes_the_served_endpoint_from_the_data_planes_metadata(epick, pool):
    svc = epick(pool, conformance_hooks=True)
    out = route(svc, "buffered", pool[0], then=[response_headers_msg("200", served=pool[0])])
    headers = set_headers(out[-1].response_headers.response)
    assert headers[SERVED] == pool[0] and headers[SELECTED] == pool[0]
    # No served-endpoint metadata: upstream's reference picker's failure text.
    out = route(svc, "buffered", pool[1], then=[response_headers_msg("200")])
    headers = set_headers(out[-1].response_headers.response)
    assert headers[SERVED] == "fail: missing envoy lb metadata"
    assert headers[SELECTED] == pool[1]


def test_off_by_default_the_header_is_ignored_and_nothing_is_echoed(epick, pool, mode):
    svc = epick(pool)
    picked = {destination(route(svc, mode, pool[0]), mode) for _ in range(15)}
    assert len(picked) > 1, "the header steered the pick with the hooks off"
    out = route(svc, "buffered", pool[0], then=[response_headers_msg("200", served=pool[0])])
    headers = set_headers(out[-1].response_headers.response)
    assert SERVED not in headers and SELECTED not in headers
