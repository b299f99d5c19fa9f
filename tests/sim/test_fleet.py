import math
import time

import msgspec
import pytest

from epick.sim.config import DEFAULT_CONFIG
from epick.sim.fleet import Fleet
from epick.sim.routers import LeastQueueRouter, RandomRouter, RoundRobinRouter
from epick.sim.workload import SimRequest, multi_lora, shared_prefix, zero_hit

lora_cfg = msgspec.structs.replace(DEFAULT_CONFIG, max_loras=3)


def test_a_minute_of_multi_lora_traffic_runs_in_seconds():
    wl = multi_lora(qps=20, duration_s=60, seed=1)
    t0 = time.process_time()
    res = Fleet(4, lora_cfg, seed=1).run(wl, RandomRouter(1))
    cpu = time.process_time() - t0
    s = res.summary
    assert s.requests == len(wl) == len(res.records)
    assert s.output_tokens == sum(r.max_tokens for r in wl)
    assert s.duration_s > 60
    assert cpu < 30  # generous: a shared 2-core machine; typically ~0.5 s
    assert 0 < s.ttft_p50_s <= s.ttft_p90_s <= s.ttft_p99_s
    assert s.adapter_loads == sum(r.adapter_loads for r in res.replicas) > 0
    groups = res.by_group()
    assert list(groups) == ["g0", "g1", "g2"]
    assert sum(g.requests for g in groups.values()) == s.requests
    assert sum(g.adapter_loads for g in groups.values()) == s.adapter_loads
    assert groups["g0"].requests > groups["g1"].requests > groups["g2"].requests


def test_same_seed_same_run_and_records_are_in_arrival_order():
    wl = multi_lora(qps=30, duration_s=5, adapters=6, seed=2)
    a = Fleet(3, lora_cfg, seed=7).run(wl, RandomRouter(3))
    b = Fleet(3, lora_cfg, seed=7).run(wl, RandomRouter(3))
    assert a.records == b.records and a.summary == b.summary
    assert [r.request_id for r in a.records] == [r.request_id for r in wl]
    c = Fleet(3, lora_cfg, seed=7).run(wl, RandomRouter(4))
    assert c.records != a.records


def test_prefix_affine_routing_beats_random_on_shared_prefix_traffic():
    wl = shared_prefix(qps=10, duration_s=20, tenants=40, prefix_tokens=3000, seed=3)
    small = msgspec.structs.replace(DEFAULT_CONFIG, num_gpu_blocks=6000)

    class ByTenant:
        def route(self, req, view):
            return int(req.group.split("-")[1]) % len(view)

    fleet = Fleet(4, small, seed=3)
    rnd = fleet.run(wl, RandomRouter(3)).summary
    aff = fleet.run(wl, ByTenant()).summary
    assert aff.prefix_cache_hit_rate > rnd.prefix_cache_hit_rate + 0.2
    assert aff.ttft_p50_s < rnd.ttft_p50_s


def test_adapter_affine_routing_beats_random_on_multi_lora_traffic():
    wl = multi_lora(qps=40, duration_s=20, adapters=8, split=(0.5, 0.5), seed=4)

    class ByAdapter:
        def route(self, req, view):
            return int(req.adapter.split("-")[1]) % len(view)

    fleet = Fleet(4, msgspec.structs.replace(DEFAULT_CONFIG, max_loras=2), seed=4)
    rnd = fleet.run(wl, RandomRouter(4)).summary
    aff = fleet.run(wl, ByAdapter()).summary
    assert aff.adapter_loads < rnd.adapter_loads / 10
    assert aff.ttft_p90_s < rnd.ttft_p90_s / 2


def test_router_sees_metrics_only_as_of_the_last_scrape():
    seen = []

    class Spy:
        def route(self, req, view):
            seen.append((view.now, view.scraped_at(0), view.metrics(0).running + view.metrics(0).waiting))
            return 0

    wl = [SimRequest(request_id=f"r{i}", arrival_s=0.001 * i, prompt="x" * 400, max_tokens=50) for i in range(20)]
    Fleet(1, DEFAULT_CONFIG, seed=0).run(wl, Spy(), scrape_interval_s=10.0)
    # One scrape at t=0, the next is seconds away: every request saw the empty fleet.
    assert all(scraped == 0.0 and load == 0 for _, scraped, load in seen)


def test_scrapes_refresh_the_view_at_the_interval():
    seen = []

    class Spy:
        def route(self, req, view):
            seen.append(view.now - view.scraped_at(0))
            return 0

    wl = zero_hit(qps=20, duration_s=5, seed=1)
    Fleet(1, DEFAULT_CONFIG, seed=0).run(wl, Spy(), scrape_interval_s=0.05)
    assert max(seen) <= 0.05 + 1e-9


def test_view_version_moves_with_every_scrape_and_only_then():
    versions = []

    class Spy:
        def route(self, req, view):
            versions.append((view.version, view.scraped_at(0), view.scraped_at(1)))
            return 0

    wl = zero_hit(qps=50, duration_s=2, seed=1)
    Fleet(2, DEFAULT_CONFIG, seed=0).run(wl, Spy(), scrape_interval_s=0.1)
    for (v1, a1, b1), (v2, a2, b2) in zip(versions, versions[1:]):
        assert (v1 == v2) == ((a1, b1) == (a2, b2))


def test_on_complete_is_called_once_per_request_with_its_replica():
    done = []

    class RR(RoundRobinRouter):
        def on_complete(self, req, replica):
            done.append((req.request_id, replica))

    wl = zero_hit(qps=20, duration_s=2, seed=1)
    res = Fleet(2, DEFAULT_CONFIG).run(wl, RR())
    assert sorted(done) == sorted((r.request_id, r.replica) for r in res.records)


@pytest.mark.parametrize("bad", [2, -1, "0", True, None], ids=["too-big", "negative", "str", "bool", "none"])
def test_a_router_returning_a_non_index_is_named_in_the_error(bad):
    class Bad:
        def route(self, req, view):
            return bad

    wl = zero_hit(qps=5, duration_s=1, seed=1)
    msg = f"router Bad returned {bad!r} for request 'zero-0'; expected an int in [0, 2)"
    with pytest.raises(ValueError, match="^" + msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)") + "$"):
        Fleet(2, DEFAULT_CONFIG).run(wl, Bad())


def test_workload_out_of_order_is_refused():
    wl = [SimRequest(request_id="a", arrival_s=1.0, prompt="x", max_tokens=1),
          SimRequest(request_id="b", arrival_s=0.5, prompt="x", max_tokens=1)]
    with pytest.raises(ValueError, match="workload is not in arrival order: 'b' at 0.5 after a request at 1.0"):
        Fleet(1).run(wl, RoundRobinRouter())


def test_least_queue_router_uses_the_view():
    wl = zero_hit(qps=40, duration_s=5, seed=2)
    res = Fleet(3, DEFAULT_CONFIG, seed=2).run(wl, LeastQueueRouter())
    counts = [r.requests for r in res.replicas]
    assert min(counts) > 0.2 * len(wl)


def test_empty_workload_gives_an_empty_summary():
    res = Fleet(2).run([], RandomRouter())
    assert (res.summary.requests, res.records, res.summary.ttft_p50_s) == (0, (), 0.0)
    assert not math.isnan(res.summary.output_tok_s)


def test_on_finished_gets_each_request_record_instead_of_on_complete():
    seen, plain = [], []

    class RR(RoundRobinRouter):
        def on_complete(self, req, replica):
            plain.append(req.request_id)

        def on_finished(self, req, replica, record):
            seen.append((req.request_id, replica, record))

    wl = zero_hit(qps=20, duration_s=2, seed=1)
    res = Fleet(2, DEFAULT_CONFIG).run(wl, RR())
    assert plain == []
    assert sorted((r, i) for r, i, _ in seen) == sorted((r.request_id, r.replica) for r in res.records)
    assert all(rec.request_id == r and rec.ttft_s > 0 for r, _, rec in seen)


def test_a_heterogeneous_fleet_runs_each_replica_on_its_own_config():
    slow = msgspec.structs.replace(DEFAULT_CONFIG, prefill_tokens_per_s=2_500.0,
                                   decode_step_base_s=0.04, num_gpu_blocks=4_000)
    wl = zero_hit(qps=4, duration_s=5, seed=1, prompt_tokens=2000)
    res = Fleet(2, DEFAULT_CONFIG, configs=[DEFAULT_CONFIG, slow]).run(wl, RoundRobinRouter())
    fast_ttft = [r.ttft_s for r in res.records if r.replica == 0]
    slow_ttft = [r.ttft_s for r in res.records if r.replica == 1]
    # 2,000 tokens: 80 ms of prefill at 25k tok/s, 800 ms at 2.5k
    assert max(fast_ttft) < 0.3 < 0.7 < min(slow_ttft)
    with pytest.raises(ValueError, match="configs has 1 entries for 2 replicas"):
        Fleet(2, DEFAULT_CONFIG, configs=[slow])
