"""NGINX / HAProxy -> epick's HTTP API -> replicas, all real processes and sockets on free
ports (``make test-dataplanes``; not part of ``make test``: tests/conftest.py collects this
folder only when ``EPICK_TEST_DATAPLANES`` is set, and then a missing binary fails).

Fixtures:
    replicas(n, page=..., **kw)    start n replicas (tests/envoy/replica.py), stopped after
    epick(addresses, **kw)         a Service with [http] on a free port, on its own thread
    proxy(epick, replicas, fail_open=False)   the committed example of ``proxy_kind``
                                   rendered on free ports: every test that uses it runs
                                   twice, once through NGINX, once through HAProxy
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from dataplane_config import make_config
from epick_service import running

from epick.bench.dataplanes import KINDS, Proxy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "envoy"))
from replica import replicas_fixture  # noqa: E402, F401  (the Envoy tests' replica fixture, shared)


def _listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


def _fresh(svc) -> set[str]:
    view = svc.call(svc.service.scheduler.current_view)
    return {view.addresses[i] for i in view.fresh}


@pytest.fixture
def epick(tmp_path) -> Iterator:
    """``epick(addresses, **openai)``: a running service (tests/epick_service.py), returned
    once every address that accepts connections is fresh in its pool: a test's first
    request must not race the first scrape (on a loaded machine it can take seconds)."""
    with ExitStack() as stack:
        def start(addresses, **kw):
            svc = stack.enter_context(running(make_config(addresses, tmp_path, **kw)))
            live = {a for a in addresses if _listening(a)}
            deadline = time.monotonic() + 15
            while not live <= _fresh(svc) and time.monotonic() < deadline:
                time.sleep(0.02)
            return svc
        yield start


@pytest.fixture(params=sorted(KINDS))
def proxy_kind(request) -> str:
    return request.param


@pytest.fixture
def proxy(proxy_kind) -> Iterator:
    started: list[Proxy] = []

    def start(svc, replicas: list[str], *, fail_open: bool = False) -> Proxy:
        p = Proxy(proxy_kind, epick_http_port=svc.service.http_port, replicas=replicas,
                  fail_open=fail_open)
        started.append(p)
        return p.start()

    yield start
    for p in started:
        p.stop()
