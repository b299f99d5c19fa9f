"""The simulator's /metrics page, read with epick's own parser (epick.pool.parse)."""

import random

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epick.abi import EndpointMetrics
from epick.pool.parse import parse_metrics, parse_page
from epick.sim import metrics as sim_metrics
from epick.sim.config import DEFAULT_CONFIG
from epick.sim.fleet import Fleet
from epick.sim.metrics import MetricsPage, PageState
from epick.sim.replica import Replica
from epick.sim.workload import multi_lora

cfg = msgspec.structs.replace(DEFAULT_CONFIG, max_loras=1)
older = msgspec.structs.replace(cfg, lora_metrics="older")
URL = "http://h:1/metrics"


def read(text: bytes, previous: EndpointMetrics | None = None, address: str = "h:1"):
    return parse_page(text.decode(), engine="vllm", url=URL, previous=previous, address=address)


def run(r: Replica, page: MetricsPage, until: float = float("inf")) -> None:
    """Advance ``r`` step by step, recording after each as the HTTP driver does."""
    while (t := r.next_event_time()) is not None and t <= until:
        r.advance(t)
        page.record()


def samples(text: bytes) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text.decode()):
        out.setdefault(fam.name, []).extend(fam.samples)
    return out


def lora_series(text: bytes) -> dict[tuple[str, str], float]:
    return {(s.labels["running_lora_adapters"], s.labels["waiting_lora_adapters"]): s.value
            for s in samples(text).get("vllm:lora_requests_info", [])}


def by_reason(text: bytes) -> dict[str, float]:
    return {s.labels["reason"]: s.value for s in samples(text)["vllm:num_requests_waiting_by_reason"]}


def test_fresh_page_declares_lora_without_series_and_reads_as_one_free_slot():
    page = MetricsPage(Replica(cfg), clock_origin=1_000.0)
    text = page.render()
    assert b"# HELP vllm:lora_requests_info Running stats on lora requests.\n" \
           b"# TYPE vllm:lora_requests_info gauge\n" in text
    assert lora_series(text) == {}
    got = read(text)
    assert (got.lora_format, got.metrics.max_lora, got.models) == ("declared", 1, ("sim-base",))
    (info,) = samples(text)["vllm:cache_config_info"]
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"], info.labels["engine"],
            info.value) == ("16", "26000", "0", 1.0)


def test_every_series_carries_the_model_and_engine_where_vllm_puts_them(drain):
    r = Replica(msgspec.structs.replace(cfg, model="m-7b"))
    page = MetricsPage(r, clock_origin=1_000.0, engine="0")
    r.submit("a", "x" * 400, 5, now=0.0, adapter="a")
    drain(r)
    for name, series in samples(page.render()).items():
        for s in series:
            if name == "vllm:lora_requests_info":
                assert set(s.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
            elif name == "vllm:cache_config_info":
                assert "model_name" not in s.labels and s.labels["engine"] == "0"
            elif name.startswith("vllm:"):
                assert s.labels.get("model_name") == "m-7b", s
                if not name.startswith("vllm:admission_rejections"):
                    assert s.labels.get("engine") == "0", s


def test_current_format_lists_admitted_adapters_in_both_and_counts_deferred_apart(drain):
    r = Replica(msgspec.structs.replace(cfg, max_loras=2))
    page = MetricsPage(r, clock_origin=1_000.0)
    for i, adapter in enumerate(("b", "a", "c", "c", "")):
        r.submit(f"r{i}", "x" * 400, 300, now=0.0, adapter=adapter)
    run(r, page, until=0.5)
    text = page.render()
    series = lora_series(text)
    newest = max(series, key=series.get)
    assert newest == ("b,a", "b,a")  # vLLM's dict order: first admitted first
    assert "c" not in {n for combo in series for n in ",".join(combo).split(",")}
    assert by_reason(text) == {"capacity": 0.0, "deferred": 2.0}
    got = read(text)
    assert (got.lora_format, got.metrics.running_adapters, got.metrics.waiting_adapters) == (
        "current", ("b", "a"), ())
    assert (got.metrics.waiting, got.metrics.deferred, got.metrics.running) == (2, 2, 3)
    run(r, page)
    idle = page.render()
    assert ("c", "c") in lora_series(idle)
    assert max(lora_series(idle).items(), key=lambda kv: kv[1])[0] == ("", "")
    # Idle: the newest non-empty list is what the engine holds (the last adapters run).
    assert read(idle).metrics.running_adapters == ("c",)
    assert by_reason(idle) == {"capacity": 0.0, "deferred": 0.0}


def test_older_format_reports_disjoint_running_and_waiting_sets(drain):
    r = Replica(older)
    page = MetricsPage(r, clock_origin=1_000.0)
    r.submit("a", "x" * 400, 200, now=0.0, adapter="a")
    r.submit("b", "y" * 400, 5, now=0.0, adapter="b")
    run(r, page, until=0.5)
    text = page.render()
    assert max(lora_series(text).items(), key=lambda kv: kv[1])[0] == ("a", "b")
    got = read(text)
    assert (got.lora_format, got.metrics.running_adapters, got.metrics.waiting_adapters,
            got.metrics.deferred) == ("older", ("a",), ("b",), 1)
    run(r, page)
    series = lora_series(page.render())
    assert set(series) == {("a", "b"), ("b", ""), ("", "")}  # b ran once a was done
    assert series[("", "")] == pytest.approx(1_000.0 + r.stats_at)
    assert series[("a", "b")] < series[("b", "")] < series[("", "")]


def test_waiting_by_reason_sums_to_the_queue_at_every_scrape():
    seen = set()

    class Check:
        def route(self, req, view):
            for i in range(len(view)):
                # Only the queue lines: parsing whole pages at every arrival is slow.
                text = b"\n".join(ln for ln in view.metrics_text(i).splitlines()
                                   if ln.startswith(b"vllm:num_requests_waiting"))
                (waiting,) = samples(text)["vllm:num_requests_waiting"]
                reasons = by_reason(text)
                assert reasons["capacity"] + reasons["deferred"] == waiting.value
                seen.add((reasons["capacity"] > 0, reasons["deferred"] > 0))
            return len(seen) % len(view)

    Fleet(2, cfg, seed=3).run(multi_lora(qps=40, duration_s=3, adapters=4, seed=3), Check())
    assert (False, True) in seen or (True, True) in seen  # deferral happened and was shown


def test_lora_series_are_never_dropped_until_the_very_high_cap(monkeypatch):
    def churn(page: MetricsPage, r: Replica, n: int) -> None:
        for i in range(n):
            r.submit(f"r{i}", "x" * 100, 1, now=float(i), adapter=f"a{i}")
            r.advance(float(i) + 0.03)
            page.record()
            r.advance(float(i) + 1)

    r = Replica(cfg)
    page = MetricsPage(r, clock_origin=0.0)
    churn(page, r, 300)
    grown = lora_series(page.render())
    assert len(grown) == 301  # every adapter once, and the empty list
    assert sim_metrics.LORA_SERIES_KEPT >= 10_000

    monkeypatch.setattr(sim_metrics, "LORA_SERIES_KEPT", 100)
    r = Replica(cfg)
    page = MetricsPage(r, clock_origin=0.0)
    churn(page, r, 150)
    capped = lora_series(page.render())
    assert len(capped) <= 100
    assert ("a149", "a149") in capped and ("", "") in capped  # the newest ones are kept
    assert ("a0", "a0") not in capped  # the oldest went first
    assert read(page.render()).metrics.running_adapters == ("a149",)


def test_page_without_lora_has_no_lora_family_and_max_lora_zero():
    r = Replica(msgspec.structs.replace(cfg, max_loras=0))
    text = MetricsPage(r, clock_origin=0.0).render()
    assert b"lora_requests_info" not in text
    got = read(text)
    assert (got.lora_format, got.metrics.max_lora) == ("none", 0)


def test_a_sleeping_replica_says_so_and_serves_nothing(drain):
    r = Replica(cfg)
    page = MetricsPage(r, clock_origin=0.0)
    prompt = "abcd" * 100
    r.submit("warm", prompt, 2, now=0.0)
    drain(r)
    busy = r.submit("busy", "z" * 400, 500, now=1.0)
    drain(r, until=1.2)
    assert r.kv.usage > 0
    aborted = r.sleep(level=1)
    assert aborted == [busy] and r.aborted == 1
    late = r.submit("late", prompt, 2, now=1.3)
    drain(r, until=5.0)
    assert (late.output_tokens, r.next_event_time()) == (0, None)
    text = page.render()
    states = {s.labels["sleep_state"]: s.value for s in samples(text)["vllm:engine_sleep_state"]}
    assert states == {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}
    got = read(text)
    assert got.sleeping and (got.metrics.waiting, got.metrics.running, got.metrics.kv_usage) == (0, 0, 0.0)
    r.wake_up()
    drain(r)
    assert late.output_tokens == 2
    assert late.cached_tokens == 0  # level 1 discarded the prefix cache
    awake = {s.labels["sleep_state"]: s.value for s in samples(page.render())["vllm:engine_sleep_state"]}
    assert awake == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    assert not read(page.render()).sleeping
    r.sleep(level=2)
    level2 = {s.labels["sleep_state"]: s.value for s in samples(page.render())["vllm:engine_sleep_state"]}
    assert level2 == {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}
    with pytest.raises(ValueError, match="sleep level must be 0, 1 or 2, got 3"):
        r.sleep(level=3)


def test_the_hand_formatted_lines_are_what_prometheus_client_writes(drain):
    # Re-expose the parsed page with prometheus_client: identical text means our sample
    # lines (sorted labels, escaping, Go float format) are exactly its own.
    r = Replica(msgspec.structs.replace(cfg, max_loras=2, model='we"ird\\model'))
    page = MetricsPage(r, clock_origin=1_796_118_583.688747)
    for i, adapter in enumerate(('q"uote', "back\\slash", "ünï")):
        r.submit(f"r{i}", "x" * 400, 30, now=0.0, adapter=adapter)
    run(r, page)
    text = page.render()

    class Fams:
        def collect(self):
            return list(text_string_to_metric_families(text.decode()))

    reg = CollectorRegistry(auto_describe=False)
    reg.register(Fams())
    assert generate_latest(reg) == text
    assert len(lora_series(text)) >= 3


def test_counters_count_prompt_tokens_looked_up_and_found(drain):
    r = Replica(cfg)
    page = MetricsPage(r, clock_origin=1_000.0)
    prompt = "abcd" * 320  # 320 tokens: 20 full 16-token blocks
    r.submit("a", prompt, 2, now=0.0)
    drain(r)
    r.submit("b", prompt, 2, now=r.last_step_at + 1.0)
    drain(r)
    s = samples(page.render())
    (queries,), (hits,) = s["vllm:prefix_cache_queries"], s["vllm:prefix_cache_hits"]
    assert queries.name == "vllm:prefix_cache_queries_total"
    assert queries.value == r.prompt_tokens_queried == 640
    assert 0 < hits.value < queries.value  # the second request found most of the first's
    assert hits.value == r.prompt_tokens_cached
    by_source = {x.labels["source"]: x.value for x in s["vllm:prompt_tokens_by_source"]}
    assert by_source == {"local_compute": 640 - hits.value, "local_cache_hit": hits.value,
                         "external_kv_transfer": 0.0}
    assert s["vllm:generation_tokens"][0].value == 4
    success = {x.labels["finished_reason"]: x.value for x in s["vllm:request_success"]}
    assert success["length"] == 2 and success["stop"] == 0


# --- endpoint_metrics == the pool's parser on the rendered text --------------------------


def _random_state(rng: random.Random, lora: bool) -> PageState:
    names = ["a", "b", "c", "d", ""]
    series = []
    if lora:
        for _ in range(rng.randint(0, 6)):
            run = ",".join(rng.sample(names[:4], rng.randint(0, 3)))
            current = rng.random() < 0.5
            wait = run if current else ",".join(rng.sample(names[:4], rng.randint(0, 2)))
            # Few distinct times, so ties (first in page order wins) happen.
            series.append((run, wait, 1_000.0 + rng.choice([0.0, 0.5, 1.0, 1.5, 2.0])))
    # One label combination is one series.
    seen, unique = set(), []
    for s in series:
        if s[:2] not in seen:
            seen.add(s[:2])
            unique.append(s)
    waiting = rng.randint(0, 50)
    return PageState(
        rng.randint(0, 64), waiting, rng.choice([0.0, 1.0, rng.random()]), tuple(unique),
        deferred=rng.randint(0, waiting), sleep_level=rng.choice([None, None, 0, 1, 2]),
    )


PREVIOUS = [None, EndpointMetrics(address="h:1"),
            EndpointMetrics(address="h:1", running_adapters=("old",), waiting_adapters=("w",),
                            max_lora=3)]


@pytest.mark.parametrize("max_loras", [0, 1, 4])
def test_endpoint_metrics_is_the_pool_parse_of_the_page_on_many_states(max_loras):
    rng = random.Random(max_loras)
    for fmt in ("current", "older"):
        c = msgspec.structs.replace(cfg, max_loras=max_loras, lora_metrics=fmt)
        page = MetricsPage(Replica(c), clock_origin=1_000.0)
        for _ in range(60):
            state = _random_state(rng, lora=max_loras > 0)
            for previous in PREVIOUS:
                want = parse_metrics(page.render(state).decode(), engine="vllm", url=URL,
                                     previous=previous, address="h:1")
                assert page.endpoint_metrics(state, "h:1", previous) == want, (state, previous)


@pytest.mark.parametrize("fmt", ["current", "older"])
def test_the_views_metrics_are_the_pool_parse_of_every_scraped_page(fmt):
    checked = []

    class Check:
        def route(self, req, view):
            for i in range(len(view)):
                text = view.metrics_text(i).decode()
                got = parse_metrics(text, engine="vllm", url=f"http://{view.addresses[i]}/metrics",
                                    previous=view._previous[i], address=view.addresses[i])
                assert got == view.metrics(i)
                checked.append(got)
            return len(checked) % len(view)

    c = msgspec.structs.replace(cfg, max_loras=2, lora_metrics=fmt)
    Fleet(3, c, seed=5).run(multi_lora(qps=40, duration_s=3, adapters=5, seed=5), Check())
    assert any(m.running_adapters for m in checked)
    assert any(m.deferred for m in checked)
    assert any(m.waiting_adapters for m in checked) == (fmt == "older")
