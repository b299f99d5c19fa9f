"""[server] session_header: the header that names a request's session when
PickRequest.session_id is empty (issue 30); it reaches policies as Request.session_id."""

from __future__ import annotations

import msgspec
import pytest
from epick_service import make_config, running
from fakes import vllm_page

from epick import config
from epick.api.decide import Decider
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.validate import SESSION_HEADER, to_request

MODEL = "m"  # the model the fake pages name (tests/fakes.py)


def test_the_default_header_is_x_session_id():
    assert config.loads("version = 1").server.session_header == SESSION_HEADER == "x-session-id"
    q = to_request(pb.PickRequest(model="m", headers={"x-session-id": "c1"}))
    assert q.session_id == "c1"


def test_a_configured_header_names_the_session_and_the_default_one_no_longer_does():
    msg = pb.PickRequest(model="m", headers={"x-session-id": "old", "x-conversation": "c7"})
    assert to_request(msg, "x-conversation").session_id == "c7"
    assert to_request(pb.PickRequest(model="m", headers={"x-session-id": "old"}),
                      "x-conversation").session_id == ""
    # PickRequest.session_id still wins over any header.
    msg.session_id = "field"
    assert to_request(msg, "x-conversation").session_id == "field"


@pytest.mark.parametrize("value", ["X-Session-Id", "", "x session", "x-session-id:"])
def test_a_bad_header_name_is_a_config_error_naming_the_key(value):
    with pytest.raises(config.ConfigError, match=r"\$\.server\.session_header"):
        config.loads(f"version = 1\n[server]\nsession_header = {value!r}")


class Spy:
    """A scheduler stand-in that keeps the requests it is asked to schedule."""

    def __init__(self):
        self.requests = []

    def schedule(self, request, **kw):
        self.requests.append(request)
        raise RuntimeError("stop here")


def test_the_decider_reads_its_configured_header():
    spy = Spy()
    Decider(spy, session_header="x-conversation").decide(
        pb.PickRequest(model="m", headers={"x-conversation": "c3"}))
    Decider(spy).decide(pb.PickRequest(model="m", headers={"x-session-id": "c4"}))
    assert [r.session_id for r in spy.requests] == ["c3", "c4"]


def test_the_service_passes_its_configured_header_to_the_policies(fake_vllm, tmp_path):
    servers = [fake_vllm(vllm_page()) for _ in range(2)]
    c = make_config([s.address for s in servers], policies=("load",), tmp=tmp_path)
    c = msgspec.structs.replace(c, server=msgspec.structs.replace(
        c.server, session_header="x-conversation"))
    with running(c) as svc:
        seen = []
        scheduler = svc.service.scheduler
        schedule = scheduler.schedule

        def spy(request, **kw):
            seen.append(request.session_id)
            return schedule(request, **kw)

        svc.call(setattr, scheduler, "schedule", spy)
        for headers in ({"x-conversation": "c9"}, {"x-session-id": "ignored"}):
            svc.picker.Pick(pb.PickRequest(model=MODEL, headers=headers), timeout=5)
    assert seen == ["c9", ""]
