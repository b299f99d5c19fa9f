"""Real Envoy (both committed examples: BUFFERED and FULL_DUPLEX_STREAMED) through the
native front end: test_envoy_routing.py and test_envoy_failure_modes.py again with
``[server] frontend = "native"`` — the right endpoint, answers passed through intact,
usage and TTFT reported, errors with the Python front end's status and JSON body —
plus what is the native front end's own."""

from __future__ import annotations

import json

import pytest
import test_envoy_failure_modes
import test_envoy_routing
from native import collect

collect(test_envoy_routing, globals())
collect(test_envoy_failure_modes, globals())


@pytest.fixture
def epick(native_epick):
    return native_epick


# -- the native front end's own ---------------------------------------------------------

import os  # noqa: E402
from pathlib import Path  # noqa: E402

import grpc  # noqa: E402
import msgspec  # noqa: E402
from epick_service import running, spy_complete  # noqa: E402
from fakes import vllm_page  # noqa: E402
from test_ext_proc_protocol import (  # noqa: E402
    Mode,
    body_msg,
    converse,
    duplex_headers,
    headers_msg,
    observing,
    pending,
    response_body_msg,
    response_headers_msg,
    response_headers_with_id,
    wait_reported,
)
from test_frontend_workers import _alive, _kill_one_and_serve, _picks  # noqa: E402

from epick import config as cfg  # noqa: E402


def _exe(pid: int) -> str:
    return Path(os.readlink(f"/proc/{pid}/exe")).name


def _serving(svc, frontend: str):
    """``svc``, checked to be served by ``frontend`` (the C++ worker, or none)."""
    workers = svc.service.workers
    exes = {_exe(p) for p in workers.pids.values()} if workers is not None else set()
    assert exes == ({"epick-extproc"} if frontend == "native" else set()), exes
    return svc


@pytest.mark.parametrize("duplex", [False, True], ids=["buffered", "streamed"])
def test_the_same_seeds_give_the_same_picks_with_python_and_native(epick, replicas, seeded,
                                                                 native_binary, duplex):
    pool = [r.address for r in replicas(3, vllm_page())]
    runs = {}
    for frontend in ("python", "native"):
        seeded()
        svc = epick(pool, policies=("load", "prefix-cache"),
                    server={"frontend": frontend, "workers": 1})
        _serving(svc, frontend)  # really the C++ worker (or none), and only it, on the port
        runs[frontend] = _picks(svc, duplex=duplex)
        assert pending(svc) == 0
    assert runs["python"] == runs["native"]
    assert len(set(runs["python"])) > 1  # the picks vary, so agreeing means something


SSE_SPLIT = [b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choi', b'ces":[{"text":"b"}]}\n',
             b'\ndata: {"choices":[],"usage":{"prompt_tokens":5,"comp',
             b'letion_tokens":2}}\n\ndata: {"choices":[],"usage":{"prompt_tokens":9}} broken\n',
             b"\ndata: [DONE]\n\n"]


def _conversations():
    """(name, messages, the answer's eos): what both front ends must answer alike."""
    ask = {"model": "base", "prompt": "hello there", "stream": True}
    return [
        ("streamed, SSE cut mid-line, the last usage line malformed",
         [duplex_headers(), body_msg(json.dumps(ask)[:9].encode(), eos=False),
          body_msg(json.dumps(ask)[9:].encode(), eos=True),
          response_headers_msg(ctype="text/event-stream"),
          *[response_body_msg(c, eos=i == len(SSE_SPLIT) - 1) for i, c in enumerate(SSE_SPLIT)]]),
        ("buffered, a JSON answer in two chunks",
         [headers_msg(body_mode=Mode.BUFFERED, response_mode=Mode.BUFFERED),
          body_msg({"model": "base", "prompt": "hi"}),
          response_headers_msg(),
          response_body_msg(b'{"id":"x","usage":{"prompt_tokens":4,'),
          response_body_msg(b'"completion_tokens":1}}', eos=True)]),
        ("streamed, a 500 answer",
         [duplex_headers(), body_msg({"model": "base", "prompt": "x"}),
          response_headers_msg(status="500"), response_body_msg(b"oops", eos=True)]),
        ("streamed, a model rewrite",
         [duplex_headers(), body_msg({"model": "chat", "prompt": "x"}),
          response_headers_msg(), response_body_msg(b"{}", eos=True)]),
        ("buffered, a malformed body", [headers_msg(), body_msg(b"{not json")]),
        ("streamed, no such model", [duplex_headers(), body_msg({"model": "nope", "p": 1})]),
    ]


def _normal(responses, decision_ids) -> list[bytes]:
    out = []
    for r in responses:
        raw = r.SerializeToString()
        for d in decision_ids:
            raw = raw.replace(d.encode(), b"<decision>")
        out.append(raw)
    return out


def test_the_same_conversations_give_the_same_bytes_and_reports(epick, replicas, seeded,
                                                                native_binary):
    """Message by message, byte for byte (decision ids aside): the routing answers, the
    streamed chunks, the errors; and the completion reports (status, usage; TTFT only
    for SSE)."""
    pool = [r.address for r in replicas(1, vllm_page())]
    got = {}
    for frontend in ("python", "native"):
        seeded()
        svc = _serving(epick(pool, server={"frontend": frontend},
                             model_rewrites={"chat": "base"}), frontend)
        seen = spy_complete(svc)
        got[frontend] = []
        for name, messages in _conversations():
            before = len(seen)
            out = converse(svc, messages)
            wait_reported(svc)
            reports = [(kw["status"], kw["prompt_tokens"], kw["completion_tokens"],
                        kw["ttft_s"] is not None) for kw in seen[before:]]
            ids = [kw["decision_id"] for kw in seen[before:]]
            got[frontend].append((name, _normal(out, ids), reports))
    for py, native in zip(got["python"], got["native"], strict=True):
        assert py == native, py[0]
    by_name = {name: reports for name, _, reports in got["native"]}
    assert by_name["streamed, SSE cut mid-line, the last usage line malformed"] == [
        (0, 5, 2, True)]
    assert by_name["buffered, a JSON answer in two chunks"] == [(0, 4, 1, False)]
    assert by_name["streamed, a 500 answer"] == [(1, None, None, False)]


def _observed_conversations(svc) -> list:
    """(the routing stream's answers, the observer's, the reports) for the observer
    file's shapes; decision ids replaced (each run makes its own)."""
    seen = spy_complete(svc)
    events = [b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choi', b'ces":[]}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n',
              b"data: [DONE]\n\n"]
    out = []
    for status, eos_at_headers, ends, served in (("200", False, True, None),
                                                 ("503", True, True, None),
                                                 ("500", False, False, None),
                                                 ("200", False, True, "10.0.0.9:8000")):
        before = len(seen)
        routed = converse(svc, [duplex_headers(),
                                body_msg({"model": "base", "prompt": "a b", "stream": True}),
                                response_headers_msg("200", ctype="text/event-stream")],
                          observed=True)
        decision_id = routed[-1].response_headers.response.header_mutation.set_headers[
            0].header.raw_value.decode()
        headers = response_headers_with_id(decision_id, status, eos=eos_at_headers)
        if served:
            headers.metadata_context.filter_metadata["envoy.lb"].fields[
                "x-gateway-destination-endpoint-served"].string_value = served
        msgs = [observing(headers_msg()), headers]
        if not eos_at_headers:
            msgs += [observing(response_body_msg(e, eos=ends and i == len(events) - 1))
                     for i, e in enumerate(events)]
        observer = converse(svc, msgs)
        wait_reported(svc)
        reports = [(kw["decision_id"] == decision_id, kw["endpoint"] == (served or ""),
                    kw["status"], kw["prompt_tokens"], kw["completion_tokens"],
                    kw["ttft_s"] is not None) for kw in seen[before:]]
        out.append((_normal(routed, [decision_id]), observer, reports))
    # Not routed (BUFFERED headers, then an answer): the id header is stripped.
    out.append(_normal(converse(svc, [headers_msg(), response_headers_msg("200")],
                                observed=True), []))
    return out


def test_observed_conversations_give_the_same_bytes_and_reports(epick, replicas, seeded,
                                                                native_binary):
    """The observer file's two streams per request, python and native side by side: the
    routing stream's answers byte for byte (decision ids aside), the observer's none, and
    the same reports (the observer's, by the decision id it read on the answer)."""
    pool = [r.address for r in replicas(1, vllm_page())]
    got = {}
    for frontend in ("python", "native"):
        seeded()
        got[frontend] = _observed_conversations(
            _serving(epick(pool, server={"frontend": frontend}), frontend))
    assert got["python"] == got["native"]
    reports = [r for _, _, r in got["native"][:4]]
    assert reports == [[(True, True, 0, 3, 1, True)], [(True, True, 1, None, None, False)],
                       [(True, True, 2, 3, 1, True)], [(True, True, 0, 3, 1, True)]]


def _health(svc, names) -> dict:
    """Check's answer per name (a status, or the gRPC code), and each name's Watch stream
    through NOT_SERVING and back (the service's health flipped by its policies)."""
    import threading
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{svc.ext_proc_port}")
    stub = health_pb2_grpc.HealthStub(channel)

    def check(name):
        try:
            return stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
        except grpc.RpcError as exc:
            return exc.code().name

    deadline = time.monotonic() + 20
    while check("") != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "never SERVING"
        time.sleep(0.05)
    out = {"check": {n: check(n) for n in names}}
    calls, seen = [], {n: [] for n in names}

    def watch(name):
        call = stub.Watch(health_pb2.HealthCheckRequest(service=name))
        calls.append(call)
        try:
            for msg in call:
                seen[name].append(msg.status)
        except grpc.RpcError:
            pass

    threads = [threading.Thread(target=watch, args=(n,), daemon=True) for n in names]
    for t in threads:
        t.start()

    def settle():
        time.sleep(0.5)

    settle()
    svc.call(setattr, svc.service, "_policies_loaded", False)  # the health loop: NOT_SERVING
    settle()
    out["check_down"] = check("")
    svc.call(setattr, svc.service, "_policies_loaded", True)
    settle()
    for call in calls:
        call.cancel()
    for t in threads:
        t.join(5)
    channel.close()
    out["watch"] = seen
    return out


def test_health_check_and_watch_answer_as_the_python_front_end(epick, replicas, native_binary):
    from grpc_health.v1 import health_pb2

    pool = [r.address for r in replicas(1, vllm_page())]
    names = ("", "liveness", "readiness", "epick.v1.EndpointPicker",
             "envoy.service.ext_proc.v3.ExternalProcessor", "nope")
    got = {f: _health(_serving(epick(pool, server={"frontend": f}), f), names)
           for f in ("python", "native")}
    assert got["python"] == got["native"]
    serving, down = (health_pb2.HealthCheckResponse.SERVING,
                     health_pb2.HealthCheckResponse.NOT_SERVING)
    native = got["native"]
    assert native["check"] == {**dict.fromkeys(names[:-1], serving), "nope": "NOT_FOUND"}
    assert native["check_down"] == down
    assert native["watch"][""] == [serving, down, serving]
    assert native["watch"]["liveness"] == [serving]
    assert native["watch"]["nope"] == [health_pb2.HealthCheckResponse.SERVICE_UNKNOWN]


def _native_config(tmp_path, pool, workers: int) -> cfg.Config:
    return msgspec.convert({
        "version": 1, "server": {"listen": "127.0.0.1:0", "metrics_listen": "",
                                 "workers": workers, "frontend": "native"},
        "pool": {"scrape_interval_ms": 20, "stale_after_ms": 5000,
                 "endpoints": [{"address": a} for a in pool]},
        "policies": [{"name": "load", "module": "load"}],
        "runtime": {"cache_dir": str(tmp_path / "cache")}, "admin": {"listen": ""},
        "ext_proc": {"listen": "127.0.0.1:0", "base_model": "base"}}, cfg.Config)


def test_native_workers_share_the_port_restart_when_killed_and_stop_with_the_service(
        tmp_path, replicas, native_binary):
    pool = [r.address for r in replicas(2, vllm_page())]
    with running(_native_config(tmp_path, pool, 2)) as svc:
        assert {_exe(p) for p in svc.service.workers.pids.values()} == {"epick-extproc"}
        now = _kill_one_and_serve(svc, pool)
    assert not any(_alive(p) for p in now.values()), "a native worker outlived the service"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_missing_native_binary_is_a_clear_error(tmp_path, replicas, monkeypatch):
    monkeypatch.setenv("EPICK_EXTPROC_BINARY", str(tmp_path / "nowhere" / "epick-extproc"))
    with pytest.raises(BaseException) as err:  # noqa: PT011 (a group: checked below)
        with running(_native_config(tmp_path, [replicas(1, vllm_page())[0].address], 1)):
            pass
    assert err.group_contains(FileNotFoundError, match="make native")


def test_with_flow_control_a_native_workers_request_is_decided_through_the_queue(
        tmp_path, replicas, native_binary):
    """Flow control on: the hub answers a native worker's request from a task (the pick
    may wait), with the same answers."""
    pool = [r.address for r in replicas(2, vllm_page())]
    config = _native_config(tmp_path, pool, 1)
    config = msgspec.structs.replace(config, flow_control=msgspec.structs.replace(
        config.flow_control, enabled=True))
    with running(config) as svc:
        assert svc.service.hub.decider.flow is not None  # the queued path, below
        seen = spy_complete(svc)
        out = converse(svc, [duplex_headers(), body_msg({"model": "base", "prompt": "hi"}),
                             response_headers_msg(), response_body_msg(b"{}", eos=True)])
        assert out[0].request_headers.response.header_mutation.set_headers[0].header.key == (
            "x-gateway-destination-endpoint")
        wait_reported(svc)
        assert [kw["status"] for kw in seen] == [0]
        bad = converse(svc, [duplex_headers(), body_msg(b"{not json")])
        assert bad[0].immediate_response.status.code == 400


def _auto_config(tmp_path, pool, **server) -> cfg.Config:
    """The config with no ``frontend`` named: the default, ``auto``."""
    config = _native_config(tmp_path, pool, 1)
    defaults = msgspec.structs.asdict(config.server)
    del defaults["frontend"]
    return msgspec.structs.replace(config, server=msgspec.convert(
        {**defaults, **server}, cfg.ServerConfig))


def _routes(svc) -> bool:
    out = converse(svc, [duplex_headers(), body_msg({"model": "base", "prompt": "hi"})])
    return out[0].request_headers.response.header_mutation.set_headers[0].header.key == (
        "x-gateway-destination-endpoint")


def test_auto_serves_native_when_it_is_built_and_says_so(tmp_path, replicas, native_binary,
                                                         caplog):
    caplog.set_level("INFO", logger="epick.service")
    pool = [r.address for r in replicas(1, vllm_page())]
    config = _auto_config(tmp_path, pool)
    assert config.server.frontend == "auto"  # the default
    with running(config) as svc:
        assert svc.service.frontend == "native"
        assert {_exe(p) for p in svc.service.workers.pids.values()} == {"epick-extproc"}
        assert _routes(svc)
    (line,) = [r.getMessage() for r in caplog.records if 'frontend = "auto"' in r.getMessage()]
    assert "native front end" in line and str(native_binary) in line


def test_auto_without_the_native_binary_serves_python_and_says_why(tmp_path, replicas,
                                                                   monkeypatch, caplog):
    """A wheel without the C++ worker (or a checkout before `make native`) still starts."""
    caplog.set_level("INFO", logger="epick.service")
    monkeypatch.setenv("EPICK_EXTPROC_BINARY", str(tmp_path / "nowhere" / "epick-extproc"))
    pool = [r.address for r in replicas(1, vllm_page())]
    with running(_auto_config(tmp_path, pool)) as svc:
        assert svc.service.frontend == "python"
        assert svc.service.workers is None  # ext_proc in the service's own process
        assert _routes(svc)
    (line,) = [r.getMessage() for r in caplog.records if 'frontend = "auto"' in r.getMessage()]
    assert "python front end" in line and "make native" in line


def test_auto_keeps_python_when_http_is_served_by_several_workers(tmp_path, replicas,
                                                                  native_binary, caplog):
    """[http] with workers > 1 is served by Python's workers: auto keeps them."""
    caplog.set_level("INFO", logger="epick.service")
    pool = [r.address for r in replicas(1, vllm_page())]
    config = _auto_config(tmp_path, pool, workers=2)
    config = msgspec.structs.replace(config, http=cfg.HttpConfig(listen="127.0.0.1:0"))
    with running(config) as svc:
        assert svc.service.frontend == "python"
        assert {_exe(p) for p in svc.service.workers.pids.values()} != {"epick-extproc"}
        assert _routes(svc)
    (line,) = [r.getMessage() for r in caplog.records if 'frontend = "auto"' in r.getMessage()]
    assert "python front end" in line and "workers = 2" in line


def _raw_process(svc, messages) -> list[bytes]:
    """The worker's answers to ``messages`` as the bytes it wrote (no parse, no
    re-serialization)."""
    with grpc.insecure_channel(f"127.0.0.1:{svc.ext_proc_port}") as channel:
        call = channel.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=lambda m: m.SerializeToString(), response_deserializer=None)
        return list(call(iter(messages), timeout=20))


def test_streamed_chunks_come_back_exactly_as_protobuf_writes_them(epick, replicas,
                                                                   native_binary):
    """The worker writes each streamed answer's five nested heads by hand: at every varint
    width boundary of the chunk and of each enclosing length (127/128, 16383/16384 bytes),
    and for an empty last chunk, its bytes are protobuf's own serialization of the same
    message, and the bodies are the chunks sent, in order, both ways."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    svc = _serving(epick([r.address for r in replicas(1, vllm_page())],
                         server={"frontend": "native"}), "native")
    doc = json.dumps({"model": "base", "prompt": "x" * 33_000, "stream": True}).encode()
    cuts, at = [], 0
    for n in (1, 127, 128, 16_256, 16_383):
        cuts.append(doc[at:at + n])
        at += n
    cuts.append(doc[at:])
    answer = [b"a" * n for n in [*range(118, 131), *range(16_372, 16_387)]] + [b""]
    out = _raw_process(svc, [duplex_headers(),
                             *[body_msg(c, eos=i == len(cuts) - 1) for i, c in enumerate(cuts)],
                             response_headers_msg(ctype="text/event-stream"),
                             *[response_body_msg(c, eos=i == len(answer) - 1)
                               for i, c in enumerate(answer)]])
    streamed = {"request_body": [], "response_body": []}
    for raw in out:
        msg = ep.ProcessingResponse.FromString(raw)
        kind = msg.WhichOneof("response")
        if kind not in streamed:
            continue
        mutation = getattr(msg, kind).response.body_mutation
        if mutation.HasField("streamed_response"):
            assert raw == msg.SerializeToString(), (kind, len(raw))
            part = mutation.streamed_response
            streamed[kind].append((part.body, part.end_of_stream))
    assert streamed["request_body"] == [(c, i == len(cuts) - 1) for i, c in enumerate(cuts)]
    assert streamed["response_body"] == [(c, i == len(answer) - 1)
                                         for i, c in enumerate(answer)]
