"""The host filters on their own: fresh, awake, serves-model, admission."""

from __future__ import annotations

import pytest

from epick import abi
from epick.abi import Criticality
from epick.interfaces import Cycle, EndpointInfo, PoolView
from epick.scheduler.filters import AdmissionFilter, AwakeFilter, FreshFilter, ServesModelFilter


def cycle(*info: EndpointInfo, metrics=None, **request) -> Cycle:
    metrics = metrics or [{}] * len(info)
    eps = tuple(abi.EndpointMetrics(address=f"10.0.0.{i}:8000", **m)
                for i, m in enumerate(metrics))
    view = PoolView.build(abi.Snapshot(version=1, timestamp_ms=0, endpoints=eps), info)
    request.setdefault("model", "m")
    return Cycle(view=view, request=abi.Request(**request))


ALL = (0, 1, 2)


def test_fresh_keeps_fresh_endpoints_on_the_fast_path_and_on_a_subset():
    c = cycle(EndpointInfo(), EndpointInfo(fresh=False), EndpointInfo())
    assert FreshFilter().filter(c, ALL) == (0, 2)  # every endpoint: the precomputed answer
    assert FreshFilter().filter(c, (1, 2)) == (2,)


def test_awake_drops_sleeping_engines_and_passes_all_when_none_sleeps():
    c = cycle(EndpointInfo(), EndpointInfo(sleeping=True), EndpointInfo())
    assert AwakeFilter().filter(c, ALL) == (0, 2)
    awake = cycle(EndpointInfo(), EndpointInfo(), EndpointInfo())
    assert AwakeFilter().filter(awake, (2, 0)) == (2, 0)  # untouched, order kept


@pytest.mark.parametrize(("model", "adapter", "kept"), [
    ("m", "", (0, 1, 2)),  # the base model: pinned model lists include it
    ("m", "sql", (0,)),  # 1 lists only "chat", 2 no adapter; 0 says nothing (None = any)
    ("m", "chat", (0, 1)),  # endpoint 2 serves no adapter
    ("other", "", (0,)),  # endpoint 0 says nothing (None = any)
], ids=["base", "sql", "chat", "other-model"])
def test_serves_model_keeps_endpoints_that_serve_model_and_adapter(model, adapter, kept):
    c = cycle(EndpointInfo(),
              EndpointInfo(models=frozenset({"m"}), adapters=frozenset({"chat"})),
              EndpointInfo(models=frozenset({"m"}), adapters=frozenset()),
              model=model, adapter=adapter)
    assert ServesModelFilter().filter(c, ALL) == kept


def test_serves_model_answers_each_model_and_adapter_once_per_snapshot():
    """On the fresh filter's own tuple the answer is kept per (model, adapter) in the
    snapshot: asked again, in any order, every pair still gets its own answer; a
    candidate list that is not that tuple is always filtered afresh."""
    info = (EndpointInfo(), EndpointInfo(models=frozenset({"m"}), adapters=frozenset({"chat"})),
            EndpointInfo(models=frozenset({"m"}), adapters=frozenset()),
            EndpointInfo(fresh=False))
    base = cycle(*info)
    view = base.view
    expected = {("m", ""): (0, 1, 2), ("m", "sql"): (0,), ("m", "chat"): (0, 1),
                ("other", ""): (0,)}
    for _ in range(2):
        for (model, adapter), kept in expected.items():
            c = Cycle(view=view, request=abi.Request(model=model, adapter=adapter))
            assert ServesModelFilter().filter(c, FreshFilter().filter(c, (0, 1, 2, 3))) == kept
    assert set(view.serving) == set(expected)
    chat = Cycle(view=view, request=abi.Request(model="m", adapter="chat"))
    assert ServesModelFilter().filter(chat, (2, 1)) == (1,)  # not the fresh tuple: afresh


def test_serves_model_keeps_a_bounded_number_of_answers_per_snapshot():
    from epick.scheduler import filters

    c = cycle(EndpointInfo(), EndpointInfo(models=frozenset({"m"})))
    for k in range(filters._MAX_CACHED + 50):  # noqa: SLF001
        asked = Cycle(view=c.view, request=abi.Request(model=f"model-{k}"))
        assert ServesModelFilter().filter(asked, c.view.fresh) == (0,)
    assert len(c.view.serving) == filters._MAX_CACHED  # noqa: SLF001


def test_serves_model_passes_everything_when_no_endpoint_is_restricted():
    c = cycle(EndpointInfo(), EndpointInfo(), EndpointInfo(), model="anything", adapter="x")
    assert ServesModelFilter().filter(c, (1, 0)) == (1, 0)


@pytest.mark.parametrize(("criticality", "kept"), [
    (Criticality.SHEDDABLE, (0,)),
    (Criticality.STANDARD, ALL),
    (Criticality.CRITICAL, ALL),
], ids=["sheddable", "standard", "critical"])
def test_admission_applies_only_to_sheddable_requests(criticality, kept):
    metrics = [dict(waiting=5, kv_usage=0.8),  # at both thresholds: admitted
               dict(waiting=6, kv_usage=0.1),  # queue over
               dict(waiting=0, kv_usage=0.81)]  # KV over
    c = cycle(EndpointInfo(), EndpointInfo(), EndpointInfo(), metrics=metrics,
              criticality=criticality)
    assert AdmissionFilter(queue_threshold=5, kv_threshold=0.8).filter(c, ALL) == kept


def test_the_schedulers_kept_host_filter_answers_are_the_filters_own():
    """Scheduler._filter keeps the host filters' answer per view and (model, adapter); over
    random views (fresh, sleeping, model and adapter lists) and requests it must be what
    running fresh -> awake -> serves-model on every endpoint gives, view after view."""
    import random

    from epick.scheduler import scheduler as sched
    from epick.scheduler.scheduler import Scheduler

    rng = random.Random(29)
    models, adapters = ["m", "n", "o"], ["", "a", "b", "c"]
    s = Scheduler(lambda: None)
    for trial in range(300):
        n = rng.randint(1, 12)
        info = [EndpointInfo(
            fresh=rng.random() < 0.8, sleeping=rng.random() < 0.15,
            models=None if rng.random() < 0.5 else frozenset(rng.sample(models, 2)),
            adapters=None if rng.random() < 0.4 else frozenset(rng.sample(adapters[1:], 2)))
            for _ in range(n)]
        eps = tuple(abi.EndpointMetrics(address=f"10.0.0.{i}:8000") for i in range(n))
        view = PoolView.build(abi.Snapshot(version=trial, timestamp_ms=0, endpoints=eps), info)
        for _ in range(8):  # several picks on one view: the kept answers are reused
            c = Cycle(view=view, request=abi.Request(model=rng.choice(models),
                                                     adapter=rng.choice(adapters)))
            want = tuple(range(n))
            for f in (FreshFilter(), AwakeFilter(), ServesModelFilter()):
                want = f.filter(c, want)
            if not want:
                with pytest.raises(sched.Unavailable):
                    s._filter(c, s.policies, None, [], subset=None, pin="")
                continue
            assert s._filter(c, s.policies, None, [], subset=None, pin="") == want
            why: dict[int, str] = {}
            assert s._filter(c, s.policies, why, [], subset=None, pin="") == want  # explain


def test_the_kept_host_filter_answers_are_bounded_per_view(monkeypatch):
    from epick.scheduler import scheduler as sched
    from epick.scheduler.scheduler import Scheduler

    monkeypatch.setattr(sched, "_MAX_HOST_KEPT", 5)
    s = Scheduler(lambda: None)
    c0 = cycle(EndpointInfo(), EndpointInfo())
    for k in range(20):
        c = Cycle(view=c0.view, request=abi.Request(model=f"m{k}"))
        assert s._filter(c, s.policies, None, [], subset=None, pin="") == (0, 1)
    assert len(s._kept) == 5
