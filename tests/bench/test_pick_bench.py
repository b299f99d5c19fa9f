"""`epick bench pick` runs and measures both implementations on the same requests."""

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
