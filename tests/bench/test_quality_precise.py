"""`epick bench quality`'s precise router: counts from an index fed by the simulated
fleet's own KV events reach the precise-prefix policy in its ScoreInput."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from epick import abi
from epick.bench import quality
from epick.bench.kvsim import SimKvCounts, windowed_hit_rates
from epick.interfaces import Capabilities, Cycle, PoolView
from epick.kv.events import AllBlocksCleared, KVEventBatch
from epick.kv.hashing import BlockHasher
from epick.sim.config import DEFAULT_CONFIG
from epick.sim.fleet import CLOCK_ORIGIN
from epick.sim.replica import Replica
from epick.sim.results import RequestRecord
from epick.sim.tokens import token_ids

PROMPT = "abcd" * 16 * 6  # 6 blocks of 16 tokens


def served(counts: SimKvCounts, address: str, prompt: str) -> Replica:
    r = Replica(DEFAULT_CONFIG, kv_events=lambda evs: counts.on_batch(
        address, 0, KVEventBatch(ts=0.0, events=evs)))
    r.submit("a", prompt, 1, 0.0)
    while (t := r.next_event_time()) is not None:
        r.advance(t)
    return r


def test_counts_follow_the_events_per_candidate():
    kv = SimKvCounts(10_000)
    rep = served(kv, "a:1", PROMPT)
    eps = (abi.EndpointMetrics(address="a:1", block_size=16),
           abi.EndpointMetrics(address="b:1", block_size=16),
           abi.EndpointMetrics(address="c:1", block_size=0))
    req = abi.Request(prompt=PROMPT + "more")
    assert kv.counts(req, eps, (0, 1, 2)) == ((6, 6, 0), (6, -1, -1))
    assert len(BlockHasher().block_hashes(token_ids(PROMPT + "more"), 16)) == 6
    rep.sleep(1)  # AllBlocksCleared: a stream that now holds nothing
    assert kv.counts(req, eps, (1, 0)) == ((6, 6), (-1, 0))


class Recorder:
    """A score plugin that keeps the ScoreInput it was given."""

    name = "rec"
    capabilities = Capabilities.SCORE

    def __init__(self):
        self.seen: list[abi.ScoreInput] = []

    def score(self, cycle, candidates):
        blob = cycle.score_input(candidates, inline_snapshot=True)
        self.seen.append(msgspec.msgpack.decode(blob, type=abi.ScoreInput))
        return np.zeros(len(candidates))


def test_the_policy_sees_the_counts_in_its_score_input():
    kv = SimKvCounts(10_000)
    served(kv, "a:1", PROMPT)
    rec = Recorder()
    snap = abi.Snapshot(version=1, endpoints=(abi.EndpointMetrics(address="a:1", block_size=16),
                                              abi.EndpointMetrics(address="b:1", block_size=16)))
    cycle = Cycle(view=PoolView.build(snap), request=abi.Request(prompt=PROMPT), kv=kv)
    rec.score(cycle, (1, 0))
    got = rec.seen[-1]
    assert got.candidates == (1, 0)
    assert (got.prefix_blocks, got.prefix_matched) == ((6, 6), (-1, 6))
    assert got.prefix_cleared_ms == (0, 0)
    # a.1's engine empties its cache at virtual t = 2.5 s (the sim stamps batches
    # CLOCK_ORIGIN + t): the stamp reaches the policy on the bench's clock (virtual ms)
    kv.on_batch("a:1", 1, KVEventBatch(ts=CLOCK_ORIGIN + 2.5, events=[AllBlocksCleared()],
                                       data_parallel_rank=0))
    cycle = Cycle(view=PoolView.build(snap), request=abi.Request(prompt=PROMPT), kv=kv)
    rec.score(cycle, (1, 0))
    got = rec.seen[-1]
    assert got.prefix_matched == (-1, 0) and got.prefix_cleared_ms == (0, 2500)


def test_windowed_hit_rates():
    def rec(t, cached, prompt=100):
        return RequestRecord(request_id="r", group="", adapter="", replica=0, arrival_s=t,
                             ttft_s=0.1, e2e_s=1, prompt_tokens=prompt, output_tokens=1,
                             cached_tokens=cached, adapter_loads=0, preemptions=0)

    got = windowed_hit_rates([rec(0.5, 50), rec(1.2, 100), rec(1.9, 0), rec(5, 100)], 0.0, 1.0, 3)
    assert got[:2] == [0.5, 0.5] and np.isnan(got[2])


@pytest.fixture(scope="module")
def small_run():
    return quality.run(quick=True, workloads=("prefix-pressure", "prefix-restart"),
                       routers=("epick", "epick-precise"),
                       rates={"prefix-pressure": (10.0,), "prefix-restart": (20.0,)})


def test_the_precise_router_runs_both_workloads_with_their_metrics(small_run):
    pp = small_run["workloads"]["prefix-pressure"]
    assert pp["epick-precise"]["kv_evictions"][0] > 0  # cache pressure: engines evict
    assert pp["epick-precise"]["decision_cpu_us"][0] > 0
    pr = small_run["workloads"]["prefix-restart"]["epick-precise"]
    assert len(pr["hit_rate_after_restart"][0]) == quality.RESTART_WINDOWS
    assert 0 < pr["hit_rate_before_restart"][0] <= 1
    assert pr["ttft_p90_after_restart_s"][0] > 0
    # against the same run without the restart: 0.5 s windows, hits lost, misses added
    assert len(pr["hit_rate_after_restart_fine"][0]) == quality.RESTART_FINE_WINDOWS
    rec = pr["recovery_fine_s"][0]
    assert rec is None or 0 < rec <= quality.RESTART_FINE_WINDOWS * quality.RESTART_FINE_WINDOW_S
    assert -1 <= pr["hit_lost_after_restart"][0] <= 1
    assert isinstance(pr["misses_added_by_restart"][0], int)


def test_restart_stats_against_the_calm_run():
    """Hits lost and misses added are the restarted run's against the calm one's."""
    def rec(t, cached, prompt=100):
        return RequestRecord(request_id="r", group="", adapter="", replica=0, arrival_s=t,
                             ttft_s=0.1, e2e_s=1, prompt_tokens=prompt, output_tokens=1,
                             cached_tokens=cached, adapter_loads=0, preemptions=0)

    calm = [rec(t / 10, 90) for t in range(60, 180)]  # 6..18 s, 90% cached throughout
    # restarted at 10 s: the first second after it misses fully, then back to 90%
    hit = [rec(t / 10, 0 if 100 <= t < 110 else 90) for t in range(60, 180)]
    row: dict = {}
    quality._restart_stats(row, hit, 10.0, calm)
    assert row["misses_added_by_restart"] == [10]
    assert row["hit_lost_after_restart"][0] == pytest.approx(10 * 90 / (40 * 100))
    assert row["recovery_fine_s"] == [1.5]  # windows 10-10.5, 10.5-11 lost; back from 11
    assert row["recovery_s"] == [4.0]  # the 2 s windows: 10-12 is 45%, 12-14 is back


def test_unknown_router_lists_the_kv_routers():
    with pytest.raises(ValueError, match="epick-precise"):
        quality.make_router("nope", None, 0)
