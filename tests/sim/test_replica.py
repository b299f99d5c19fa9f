import msgspec
import pytest

from epick.pool.parse import parse_metrics
from epick.sim.config import DEFAULT_CONFIG, ReplicaConfig
from epick.sim.metrics import MetricsPage
from epick.sim.replica import Replica, RequestRejected, Status

cfg = DEFAULT_CONFIG


def step(ctx: int, prefill: int, c: ReplicaConfig = cfg) -> float:
    return c.decode_step_base_s + ctx * c.per_context_token_s + prefill / c.prefill_tokens_per_s


def test_ttft_on_an_idle_replica_is_frontend_plus_one_prefill_step(prompt400, drain):
    r = Replica(cfg)
    req = r.submit("r1", prompt400, 1, now=0.0)
    drain(r)
    assert req.first_token_at == pytest.approx(cfg.frontend_overhead_s + step(400, 400))
    assert 0.025 <= req.first_token_at <= 0.060  # calibration: 25-40 ms overhead + prefill


def test_prefix_caching_skips_cached_blocks_and_lowers_ttft(prompt400, drain):
    r = Replica(cfg)
    first = r.submit("r1", prompt400, 4, now=0.0)
    drain(r)
    second = r.submit("r2", prompt400, 4, now=1.0)
    drain(r)
    # 25 full blocks, but one token is always recomputed: 24 blocks hit.
    assert (first.cached_tokens, second.cached_tokens) == (0, 384)
    ttft2 = second.first_token_at - 1.0
    assert ttft2 == pytest.approx(cfg.frontend_overhead_s + step(400, 16))
    assert ttft2 < first.first_token_at - 0.010


def test_prefix_cache_is_per_adapter(prompt400, drain):
    r = Replica(cfg)
    r.submit("r1", prompt400, 1, now=0.0, adapter="a")
    drain(r)
    other = r.submit("r2", prompt400, 1, now=1.0, adapter="b")
    drain(r)
    assert other.cached_tokens == 0


def test_long_prompts_are_prefilled_in_chunks_of_the_token_budget(drain):
    c = msgspec.structs.replace(cfg, max_num_batched_tokens=256)
    r = Replica(c)
    req = r.submit("r1", "abcd" * 1000, 1, now=0.0)
    drain(r)
    chunks = [(256, 256), (512, 256), (768, 256), (1000, 232)]
    expected = c.frontend_overhead_s + sum(step(ctx, n, c) for ctx, n in chunks)
    assert r.steps == 4
    assert req.first_token_at == pytest.approx(expected)


def test_decode_runs_one_token_per_step_until_max_tokens(prompt400, drain):
    r = Replica(cfg)
    req = r.submit("r1", prompt400, 5, now=0.0)
    drain(r)
    assert (req.output_tokens, r.steps, req.status) == (5, 5, Status.FINISHED)
    decode = sum(step(400 + k, 0) for k in range(1, 5))
    assert req.finished_at - req.first_token_at == pytest.approx(decode)


def _lora_cfg(**kw) -> ReplicaConfig:
    return msgspec.structs.replace(cfg, **({"max_loras": 1, "max_cpu_loras": 1} | kw))


def test_adapter_thrash_costs_a_disk_load_per_switch(drain):
    def run(adapters: list[str]) -> tuple[int, float]:
        r = Replica(_lora_cfg())
        reqs = []
        for i, a in enumerate(adapters):
            prompt = chr(ord("k") + i) * 400  # distinct prompts: no prefix hits
            reqs.append(r.submit(f"r{i}", prompt, 10, now=float(i), adapter=a))
            drain(r)
        ttfts = [q.first_token_at - q.submitted_at for q in reqs]
        return r.lora.loads, sum(ttfts) / len(ttfts)

    same_loads, same_ttft = run(["a"] * 4)
    thrash_loads, thrash_ttft = run(["a", "b", "a", "b"])
    assert (same_loads, thrash_loads) == (1, 4)
    assert thrash_ttft - same_ttft == pytest.approx(3 / 4 * cfg.lora_load_disk_s)


def test_an_adapter_still_in_host_memory_loads_fast(drain):
    r = Replica(_lora_cfg(max_cpu_loras=4))
    for i, a in enumerate(["a", "b", "a"]):
        r.submit(f"r{i}", "q" * 400, 2, now=float(i), adapter=a)
        drain(r)
    assert (r.lora.loads, r.lora.disk_loads) == (3, 2)


@pytest.mark.parametrize("fmt, waiting_adapters", [("current", ()), ("older", ("b",))])
def test_requests_wait_for_a_slot_and_are_reported_deferred(drain, fmt, waiting_adapters):
    r = Replica(_lora_cfg(lora_metrics=fmt))
    a = r.submit("a1", "q" * 400, 200, now=0.0, adapter="a")
    b = r.submit("b1", "q" * 400, 5, now=0.0, adapter="b")
    base = r.submit("base", "q" * 400, 5, now=0.0)
    drain(r, until=0.6)
    assert (a.status, b.status, base.status) == (Status.RUNNING, Status.WAITING, Status.FINISHED)
    assert (r.num_deferred, b.deferred, r.lora_adapters(), r.waiting_adapters()) == (1, True, ["a"], ["b"])
    page = MetricsPage(r, clock_origin=1e9)
    m = parse_metrics(page.render().decode(), engine="vllm", url="http://sim:1/metrics",
                      previous=None)
    assert (m.running_adapters, m.waiting_adapters, m.waiting, m.deferred, m.max_lora) == (
        ("a",), waiting_adapters, 1, 1, 1)
    drain(r)
    assert b.first_token_at > a.finished_at  # b got the slot only once a was done
    assert (r.num_deferred, b.deferred, r.lora_adapters()) == (0, False, [])


def test_kv_exhaustion_preempts_the_latest_request_which_recomputes_later(drain):
    c = msgspec.structs.replace(cfg, num_gpu_blocks=10)
    r = Replica(c)
    old = r.submit("old", "p" * 192, 60, now=0.0)  # 48 prompt tokens, grows to 7 blocks
    new = r.submit("new", "z" * 192, 60, now=0.0)
    done = drain(r)
    assert {q.request_id for q in done} == {"old", "new"}
    assert (old.preemptions, new.preemptions) == (0, 1)
    assert r.preemptions == 1
    assert (old.output_tokens, new.output_tokens) == (60, 60)
    assert new.finished_at > old.finished_at
    assert r.kv.usage == 0.0


def test_aborting_a_running_request_releases_its_blocks_and_adapter(drain):
    r = Replica(_lora_cfg())
    r.submit("a1", "q" * 400, 100, now=0.0, adapter="a")
    drain(r, until=0.3)
    assert r.kv.usage > 0
    assert r.abort("a1") is True
    assert r.abort("a1") is False
    assert (r.kv.usage, r.num_running, r.lora.can_start("b")) == (0.0, 0, True)
    assert r.next_event_time() is not None  # the step in flight still ends
    drain(r)
    assert r.next_event_time() is None


def test_requests_too_long_for_the_model_are_rejected_with_the_numbers(drain):
    r = Replica(msgspec.structs.replace(cfg, max_model_len=100))
    with pytest.raises(RequestRejected, match=r"^request 'x': prompt \(90 tokens\) \+ max_tokens \(20\) = 110 exceeds max_model_len 100$"):
        r.submit("x", "a" * 360, 20, now=0.0)


def test_adapter_requests_are_rejected_when_lora_is_disabled(drain):
    r = Replica(msgspec.structs.replace(cfg, max_loras=0))
    with pytest.raises(RequestRejected, match="names adapter 'a' but LoRA is disabled"):
        r.submit("x", "hi", 1, now=0.0, adapter="a")


def test_duplicate_request_ids_in_flight_are_refused(drain):
    r = Replica(cfg)
    r.submit("x", "hi", 1, now=0.0)
    with pytest.raises(ValueError, match="request 'x' is already in flight on this replica"):
        r.submit("x", "hi", 1, now=0.0)


def test_tracked_adapters_follow_vllms_lora_request_states(drain):
    # An adapter is listed from its first admission until its last request leaves, in
    # first-listed order; one that leaves and comes back goes to the end.
    r = Replica(_lora_cfg(max_loras=2, max_cpu_loras=2))
    r.submit("a1", "q" * 400, 100, now=0.0, adapter="a")
    r.submit("b1", "q" * 400, 3, now=0.0, adapter="b")
    drain(r, until=0.2)
    assert r.lora_adapters() == ["a", "b"]
    drain(r, until=0.5)  # b finished
    assert r.lora_adapters() == ["a"]
    r.submit("b2", "q" * 400, 100, now=0.5, adapter="b")
    r.submit("c1", "q" * 400, 100, now=0.5, adapter="c")  # no slot: deferred, not listed
    drain(r, until=0.8)
    assert (r.lora_adapters(), r.num_deferred) == (["a", "b"], 1)
    assert r.abort("c1") and r.num_deferred == 0
    assert r.abort("a1")
    assert r.lora_adapters() == ["b"]
    drain(r)
    assert r.lora_adapters() == []


def test_a_preempted_request_keeps_its_adapter_listed(drain):
    c = msgspec.structs.replace(cfg, num_gpu_blocks=10, max_loras=2)
    r = Replica(c)
    r.submit("old", "p" * 192, 60, now=0.0, adapter="a")
    new = r.submit("new", "z" * 192, 60, now=0.0, adapter="b")
    while new.preemptions == 0:
        r.advance(r.next_event_time())
    assert new.status is Status.WAITING
    assert r.lora_adapters() == ["a", "b"]  # vLLM: PREEMPTED moves it to "waiting", still listed
    drain(r)
    assert r.lora_adapters() == []


def test_sleep_aborts_everything_in_flight_and_level_0_keeps_the_prefix_cache(drain):
    r = Replica(cfg)
    prompt = "abcd" * 100
    r.submit("warm", prompt, 2, now=0.0)
    drain(r)
    running = r.submit("running", "x" * 400, 100, now=1.0)
    drain(r, until=1.03)
    frontend = r.submit("frontend", "y" * 400, 100, now=1.03)
    assert (running.status, frontend.status) == (Status.RUNNING, Status.PENDING)
    assert set(r.sleep(level=0)) == {running, frontend}
    assert {q.status for q in (running, frontend)} == {Status.ABORTED}
    assert (r.num_in_flight, r.kv.usage, r.sleep_level) == (0, 0.0, 0)
    again = r.submit("again", prompt, 2, now=2.0)
    assert r.next_event_time() is None  # nothing is scheduled while asleep
    r.wake_up()
    drain(r)
    assert again.output_tokens == 2 and again.cached_tokens > 0  # level 0: cache kept
