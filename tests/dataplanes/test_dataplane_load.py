"""2,000 concurrent streaming requests through NGINX -> epick -> the simulated fleet: none
fails and every stream arrives whole (issue 25's load target, sized by examples/nginx)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest
from proxy_checks import wait_for
from sim_fleet import SIM_MODEL, sim_fleet

CONCURRENT = 2000
TOKENS = 8


@pytest.fixture
def open_files():
    """Room for the epick service (in this process) and the fleet (a child) to hold a
    connection per stream: CI's default soft limit may be 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 4 * CONCURRENT + 1024), hard),
                                                hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("proxy_kind", ["nginx"])
def test_2000_concurrent_streams_through_nginx_all_arrive_whole(open_files, epick, proxy):
    with sim_fleet(3) as fleet:
        svc = epick(fleet, policies=("load", "prefix-cache", "lora-affinity"),
                    base_model=SIM_MODEL)
        p = proxy(svc, fleet)
        # The client in a process of its own: 2,000 streams on this process's loop would
        # take the GIL from the service it measures.
        out = subprocess.run(
            [sys.executable, "-m", "epick.bench.proxies", "--load", p.url, "--concurrent",
             str(CONCURRENT), "--requests", str(CONCURRENT), "--model", SIM_MODEL,
             "--max-tokens", str(TOKENS)],
            capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-3000:]
        res = json.loads(out.stdout)
        assert res["errors"] == {}, (res, p.log[-3000:])
        assert res["statuses"] == {"200": CONCURRENT}, res
        assert res["peak_in_flight"] == CONCURRENT, res
        # Every stream was reported (post_action, after the client had its last byte, so
        # the last reports may still be on their way): nothing left in flight at epick.
        assert wait_for(lambda: svc.call(lambda: svc.service.scheduler.pending_decisions) == 0,
                        30), svc.call(lambda: svc.service.scheduler.pending_decisions)
