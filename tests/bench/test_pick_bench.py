"""`epick bench pick` runs and measures both implementations on the same requests."""

import random

from epick.bench import pick
from epick.bench.pypolicies import PyLoad, PyLoraAffinity, PyPrefixCache
from epick.runtime import Runtime
from epick.scheduler.scheduler import Scheduler


def test_a_small_run_measures_wasm_and_python_per_size():
    results = pick.run(sizes=(8,), picks=60, rounds=2, warmup=10)
    assert [(r.endpoints, r.impl) for r in results] == [(8, "wasm"), (8, "python")]
    assert all(len(r.samples_us) == 60 and 0 < r.p50 <= r.p99 for r in results)


def test_python_and_wasm_policies_pick_the_same_endpoints():
    """The Python twins score like the WASM modules, so the comparison is fair."""
    view = pick.synthetic_view(64)
    with Runtime() as rt:
        wasm = Scheduler(lambda: view, pick.wasm_policies(rt))
        py = Scheduler(lambda: view, pick.python_policies())
        for r in pick.request_stream(200):
            a, b = wasm.schedule(r, explain=True), py.schedule(r, explain=True)
            assert a.endpoint == b.endpoint, r.request_id
            wasm.complete(decision_id=a.decision_id)
            py.complete(decision_id=b.decision_id)
    assert isinstance(pick.python_policies().get("load").plugin, PyLoad)
    assert {type(e.plugin) for e in pick.python_policies().entries} == {
        PyLoad, PyLoraAffinity, PyPrefixCache}


def test_the_service_answer_bench_times_every_pick_of_a_real_service():
    from epick.bench.answer import measure

    lat = measure(endpoints=2, picks=40, rounds=2)
    assert len(lat) == 80 and all(x > 0 for x in lat)


def test_with_latency_measures_the_defaults_beside_them_plus_latency():
    """`--with latency`: both sets time the same picks, and the latency policy learns
    (its completions carry a TTFT), so its model state is as in service."""
    results = pick.run_with("latency", sizes=(8,), picks=60, rounds=2, warmup=10)
    assert [(r.endpoints, r.impl) for r in results] == [(8, "defaults"), (8, "+latency")]
    assert all(len(r.samples_us) == 60 and 0 < r.p50 <= r.p99 for r in results)
    with Runtime() as rt:
        policies = pick.wasm_policies(rt, ("latency",))
        sched = Scheduler(lambda view=pick.synthetic_view(8): view, policies)
        pick._time_picks_completed(sched, pick.request_stream(40, latency=True), [],
                                   random.Random(1))
        import msgspec

        state = msgspec.msgpack.decode(policies.get("latency").plugin.export_state())
    assert state[3], "no endpoint model learnt from the completions"
    assert sum(model[1][0] for _, model, _ in state[3]) >= 1, state[3]


def test_the_latency_stream_carries_what_the_latency_policy_reads():
    reqs = pick.request_stream(300, latency=True)
    assert len({r.request_id for r in reqs}) == 300
    assert all(r.prompt_tokens > 0 for r in reqs)
    assert 60 < sum(r.slo_ttft_ms > 0 for r in reqs) < 140
    assert 60 < sum(bool(r.session_id) for r in reqs) < 140
    assert pick.request_stream(3)[0].request_id == "r0"  # the default stream is unchanged
