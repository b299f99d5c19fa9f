import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epick.abi import EndpointMetrics
from epick.sim.config import DEFAULT_CONFIG
from epick.sim.fleet import Fleet
from epick.sim.metrics import LORA_SERIES_KEPT, MetricsPage, parse_metrics
from epick.sim.replica import Replica
from epick.sim.workload import multi_lora

cfg = msgspec.structs.replace(DEFAULT_CONFIG, max_loras=1)


def samples(text: bytes) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text.decode()):
        out.setdefault(fam.name, []).extend(fam.samples)
    return out


def test_page_has_the_vllm_names_types_and_labels():
    r = Replica(cfg)
    page = MetricsPage(r, clock_origin=1_000.0)
    text = page.render()
    s = samples(text)
    assert set(s) == {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:lora_requests_info", "vllm:cache_config_info", "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
    }
    assert s["vllm:num_requests_waiting"][0].labels == {"engine": "0", "model_name": "sim-base"}
    (info,) = s["vllm:cache_config_info"]
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"], info.value) == ("16", "26000", 1.0)
    (lora,) = s["vllm:lora_requests_info"]
    assert lora.labels == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert lora.value == 1_000.0
    assert b"# TYPE vllm:lora_requests_info gauge\n" in text


def test_lora_series_accumulate_and_the_newest_carries_the_latest_step_time(drain):
    r = Replica(cfg)
    page = MetricsPage(r, clock_origin=1_000.0)
    r.submit("a", "x" * 400, 200, now=0.0, adapter="a")
    r.submit("b", "y" * 400, 5, now=0.0, adapter="b")
    drain(r, until=0.5)
    page.render()
    drain(r)
    lora = samples(page.render())["vllm:lora_requests_info"]
    by_labels = {(s.labels["running_lora_adapters"], s.labels["waiting_lora_adapters"]): s.value for s in lora}
    assert set(by_labels) == {("", ""), ("a", "b")}
    assert by_labels[("", "")] == pytest.approx(1_000.0 + r.last_step_at)
    assert by_labels[("a", "b")] < by_labels[("", "")]


def test_parse_keeps_the_last_non_empty_adapter_sets_of_an_idle_server(drain):
    r = Replica(cfg)
    page = MetricsPage(r, clock_origin=1_000.0)
    r.submit("a", "x" * 400, 50, now=0.0, adapter="a")
    drain(r, until=0.3)
    busy = parse_metrics(page.render(), "h:1")
    drain(r)
    idle = parse_metrics(page.render(), "h:1", previous=busy)
    assert busy.running_adapters == idle.running_adapters == ("a",)
    assert (idle.running, idle.waiting, idle.kv_usage) == (0, 0, 0.0)


def test_fresh_page_without_adapter_history_keeps_previous_sets():
    page = MetricsPage(Replica(cfg), clock_origin=0.0)
    prev = EndpointMetrics(address="h:1", running_adapters=("z",))
    assert parse_metrics(page.render(), "h:1", prev).running_adapters == ("z",)
    assert parse_metrics(page.render(), "h:1").running_adapters == ()


def test_page_without_lora_has_no_lora_series_and_max_lora_zero():
    r = Replica(msgspec.structs.replace(cfg, max_loras=0))
    text = MetricsPage(r, clock_origin=0.0).render()
    assert b"lora_requests_info" not in text
    assert parse_metrics(text, "h:1").max_lora == 0


def test_old_lora_label_combinations_are_capped():
    r = Replica(cfg)
    page = MetricsPage(r, clock_origin=0.0)
    for i in range(LORA_SERIES_KEPT + 5):
        r.submit(f"r{i}", "x" * 100, 1, now=float(i), adapter=f"a{i}")
        r.advance(float(i) + 0.03)
        page.record()
        r.advance(float(i) + 1)
    assert len(samples(page.render())["vllm:lora_requests_info"]) == LORA_SERIES_KEPT


def test_parse_error_names_the_endpoint():
    with pytest.raises(ValueError, match=r"^h:1: not a Prometheus metrics page"):
        parse_metrics("vllm:num_requests_waiting{ 1\n", "h:1")


def test_views_direct_metrics_equal_parsing_the_rendered_text():
    seen = []

    class Check:
        def route(self, req, view):
            for i in range(len(view)):
                prev = view._previous[i]
                assert view.metrics(i) == parse_metrics(view.metrics_text(i), view.addresses[i], prev)
            seen.append(view.metrics(0))
            return len(seen) % len(view)

    Fleet(3, cfg, seed=3).run(multi_lora(qps=30, duration_s=3, adapters=4, seed=3), Check())
    assert any(m.running_adapters for m in seen)
    assert any(m.waiting for m in seen)


def test_the_pools_parser_reads_the_simulated_pages_as_the_view_does():
    # Interop: phase 2 feeds view.metrics_text(i) to epick.pool.parse_metrics.
    from epick.pool.parse import parse_metrics as pool_parse

    checked = []

    class Check:
        def route(self, req, view):
            for i in range(len(view)):
                text = view.metrics_text(i).decode()
                got = pool_parse(text, engine="vllm", url=f"http://{view.addresses[i]}/metrics",
                                 previous=view._previous[i], address=view.addresses[i])
                assert got == view.metrics(i)
                checked.append(got)
            return len(checked) % len(view)

    Fleet(3, cfg, seed=5).run(multi_lora(qps=30, duration_s=3, adapters=4, seed=5), Check())
    assert any(m.waiting_adapters for m in checked)


def test_prefix_cache_counters_count_prompt_tokens_looked_up_and_found(drain):
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
