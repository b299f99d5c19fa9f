"""parse_metrics: engine names, LoRA rules, value checks and exact error messages."""

from __future__ import annotations

import pytest
from fakes import vllm_page

from epick.abi import EndpointMetrics
from epick.pool import ScrapeError, parse_metrics
from epick.pool.parse import parse_page

URL = "http://10.0.0.7:8000/metrics"


def parse(text: str, *, engine: str = "vllm", previous: EndpointMetrics | None = None):
    return parse_metrics(text, engine=engine, url=URL, previous=previous)


def lora_series(running: str, waiting: str, ts: float, max_lora: int = 4) -> str:
    return (
        f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{running}",'
        f'waiting_lora_adapters="{waiting}"}} {ts!r}\n'
    )


BASE = (
    "vllm:num_requests_waiting 0.0\n"
    "vllm:num_requests_running 0.0\n"
    "vllm:kv_cache_usage_perc 0.0\n"
)


def test_vllm_page_gives_every_field():
    got = parse(
        vllm_page(
            waiting=3,
            running=7,
            kv=0.25,
            running_adapters="sql-lora,chat-lora",
            waiting_adapters="math-lora",
            max_lora=4,
            block_size=16,
            num_gpu_blocks=2048,
        )
    )
    assert got == EndpointMetrics(
        address="10.0.0.7:8000",
        waiting=3,
        running=7,
        kv_usage=0.25,
        running_adapters=("sql-lora", "chat-lora"),
        waiting_adapters=("math-lora",),
        max_lora=4,
        num_gpu_blocks=2048,
        block_size=16,
    )


@pytest.mark.parametrize(
    "kv_name", ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"], ids=["newer", "older"]
)
def test_vllm_kv_usage_is_read_under_either_name(kv_name):
    assert parse(vllm_page(kv=0.625, kv_name=kv_name)).kv_usage == 0.625


def test_vllm_prefers_the_newer_kv_name_when_both_are_present():
    text = BASE.replace("kv_cache_usage_perc 0.0", "kv_cache_usage_perc 0.5")
    text += "vllm:gpu_cache_usage_perc 0.9\n"
    assert parse(text).kv_usage == 0.5


def test_sglang_names_are_read_and_it_reports_no_lora():
    text = (
        "# TYPE sglang:num_queue_reqs gauge\n"
        'sglang:num_queue_reqs{model_name="m"} 5.0\n'
        'sglang:num_running_reqs{model_name="m"} 2.0\n'
        'sglang:token_usage{model_name="m"} 0.75\n'
    )
    got = parse(text, engine="sglang")
    assert (got.waiting, got.running, got.kv_usage) == (5, 2, 0.75)
    assert (got.running_adapters, got.waiting_adapters, got.max_lora) == ((), (), 0)


def test_trtllm_names_are_read():
    text = (
        "trtllm_num_requests_waiting 1\n"
        "trtllm_num_requests_running 4\n"
        "trtllm_kv_cache_utilization 0.125\n"
    )
    got = parse(text, engine="trtllm")
    assert (got.waiting, got.running, got.kv_usage) == (1, 4, 0.125)


def test_one_engines_names_are_not_read_for_another():
    with pytest.raises(ScrapeError) as info:
        parse(vllm_page(), engine="sglang")
    assert str(info.value) == (
        f"{URL}: missing sglang:num_queue_reqs (no known metric on the page: wrong engine or URL?)"
    )
    assert info.value.kind == "missing-metric"


def test_data_parallel_series_sum_counts_and_take_the_busiest_kv():
    text = (
        'vllm:num_requests_waiting{engine="0"} 2\n'
        'vllm:num_requests_waiting{engine="1"} 3\n'
        'vllm:num_requests_running{engine="0"} 1\n'
        'vllm:num_requests_running{engine="1"} 1\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.7\n'
    )
    got = parse(text)
    assert (got.waiting, got.running, got.kv_usage) == (5, 2, 0.7)


# --- lora_requests_info --------------------------------------------------------------


def test_lora_series_with_the_largest_timestamp_wins():
    text = BASE + lora_series("old", "", 100.0) + lora_series("new", "w", 300.0)
    text += lora_series("middle", "", 200.0)
    got = parse(text)
    assert (got.running_adapters, got.waiting_adapters) == (("new",), ("w",))


def test_lora_labels_are_split_on_commas_trimmed_and_empties_dropped():
    got = parse(BASE + lora_series(" a , b,,c ,", ",, d", 1.0))
    assert got.running_adapters == ("a", "b", "c")
    assert got.waiting_adapters == ("d",)


def test_lora_series_with_both_labels_empty_is_skipped_for_an_older_busy_one():
    text = BASE + lora_series("a", "", 100.0) + lora_series("", "", 200.0)
    assert parse(text).running_adapters == ("a",)


def test_lora_all_empty_series_keep_the_previous_adapter_sets_and_max_lora():
    previous = EndpointMetrics(
        address="10.0.0.7:8000", running_adapters=("kept",), waiting_adapters=("w",), max_lora=2
    )
    page = parse_page(BASE + lora_series("", "", 500.0, max_lora=4), engine="vllm", url=URL,
                      previous=previous)
    got = page.metrics
    assert (got.running_adapters, got.waiting_adapters) == (("kept",), ("w",))
    assert got.max_lora == 2  # seed 002: a series naming no adapter is skipped whole
    assert page.lora_format == "idle"


def test_lora_all_empty_series_without_previous_give_empty_sets_but_keep_max_lora():
    got = parse(BASE + lora_series("", "", 500.0, max_lora=3))
    assert (got.running_adapters, got.waiting_adapters, got.max_lora) == ((), (), 3)


# The upstream case (seed 002, PR #423): vLLM writes a series whose adapter labels are
# absent or empty once the server has no request in flight; the picker keeps what the pod
# last ran, max_lora included, instead of reading "no adapters, no slots".
UPSTREAM_IDLE_SERIES = {
    "labels absent": 'vllm:lora_requests_info{max_lora="4"} 900.0\n',
    "no labels at all": "vllm:lora_requests_info 900.0\n",
    "labels empty": lora_series("", "", 900.0),
}


@pytest.mark.parametrize("series", UPSTREAM_IDLE_SERIES.values(), ids=UPSTREAM_IDLE_SERIES.keys())
def test_lora_upstream_idle_series_keep_the_last_sets_and_max_lora(series):
    busy = parse(BASE + lora_series("a,b", "c", 800.0))
    assert (busy.running_adapters, busy.waiting_adapters, busy.max_lora) == (("a", "b"), ("c",), 4)
    # The same page once the server went idle: the busy series stays, a newer idle one joins.
    later = parse(BASE + lora_series("a,b", "c", 800.0) + series, previous=busy)
    assert (later.running_adapters, later.waiting_adapters, later.max_lora) == (
        ("a", "b"), ("c",), 4)
    # A page carrying only the idle series (say, after a restart): the last values stand.
    alone = parse(BASE + series, previous=busy)
    assert (alone.running_adapters, alone.waiting_adapters, alone.max_lora) == (
        ("a", "b"), ("c",), 4)


def test_lora_series_without_a_max_lora_label_keeps_the_previous_value():
    previous = EndpointMetrics(address="10.0.0.7:8000", running_adapters=("a",), max_lora=3)
    text = BASE + 'vllm:lora_requests_info{running_lora_adapters="b",waiting_lora_adapters="b"} 5.0\n'
    got = parse(text, previous=previous)
    assert (got.running_adapters, got.max_lora) == (("b",), 3)


def test_no_lora_metric_means_no_lora_even_with_previous_sets():
    previous = EndpointMetrics(address="x:1", running_adapters=("a",), max_lora=4)
    got = parse(BASE, previous=previous)
    assert (got.running_adapters, got.max_lora) == ((), 0)


def test_a_bad_max_lora_label_skips_lora_names_why_and_keeps_the_rest():
    text = BASE.replace("waiting 0.0", "waiting 2.0")
    text += lora_series("a", "", 1.0).replace('max_lora="4"', 'max_lora="four"')
    page = parse_page(text, engine="vllm", url=URL, previous=None)
    assert page.metrics.waiting == 2
    assert (page.metrics.running_adapters, page.metrics.max_lora) == ((), 0)
    assert page.skipped == (
        'vllm:lora_requests_info: vllm:lora_requests_info{max_lora="four"} is not an integer >= 0',
    )


def test_a_bad_max_lora_label_keeps_the_previous_sets_and_max_lora():
    previous = EndpointMetrics(
        address="10.0.0.7:8000", running_adapters=("a",), waiting_adapters=("w",), max_lora=4
    )
    text = BASE + lora_series("b", "", 2.0).replace('max_lora="4"', 'max_lora="four"')
    page = parse_page(text, engine="vllm", url=URL, previous=previous)
    got = page.metrics
    assert (got.running_adapters, got.waiting_adapters, got.max_lora) == (("a",), ("w",), 4)
    assert page.lora_format == "kept"
    assert page.skipped == (
        'vllm:lora_requests_info: vllm:lora_requests_info{max_lora="four"} is not an integer >= 0',
    )


# --- cache_config_info ------------------------------------------------------------------


def test_cache_config_none_before_profiling_reads_as_unknown():
    text = BASE + 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    got = parse(text)
    assert (got.block_size, got.num_gpu_blocks) == (16, 0)


def test_missing_cache_config_reads_as_unknown():
    got = parse(BASE)
    assert (got.block_size, got.num_gpu_blocks) == (0, 0)


# --- bad pages and values ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message", "kind"),
    [
        (
            "<html><body>502 Bad Gateway</body></html>",
            "missing vllm:num_requests_waiting (no known metric on the page: wrong engine or URL?)",
            "missing-metric",
        ),
        (
            "vllm:num_requests_waiting{engine=\"0\"} lots\n",
            "not Prometheus text format: could not convert string to float: 'lots'",
            "parse",
        ),
        ("\x00\x01\x02", "not Prometheus text format: NUL byte in page", "parse"),
        ("", "missing vllm:num_requests_waiting (no known metric on the page: wrong engine or URL?)",
         "missing-metric"),
        (
            BASE.replace("vllm:kv_cache_usage_perc 0.0\n", ""),
            "missing vllm:kv_cache_usage_perc or vllm:gpu_cache_usage_perc",
            "missing-metric",
        ),
        (
            BASE.replace("vllm:num_requests_running 0.0\n", ""),
            "missing vllm:num_requests_running",
            "missing-metric",
        ),
        (
            BASE.replace("waiting 0.0", "waiting -1.0"),
            "vllm:num_requests_waiting is -1.0; expected a count >= 0",
            "invalid-value",
        ),
        (
            BASE.replace("running 0.0", "running NaN"),
            "vllm:num_requests_running is nan; expected a count >= 0",
            "invalid-value",
        ),
        (
            BASE.replace("perc 0.0", "perc 42.0"),
            "vllm:kv_cache_usage_perc is 42.0; expected a fraction in [0, 1]",
            "invalid-value",
        ),
        (
            BASE.replace("perc 0.0", "perc -0.1"),
            "vllm:kv_cache_usage_perc is -0.1; expected a fraction in [0, 1]",
            "invalid-value",
        ),
    ],
    ids=[
        "html", "bad-number", "binary", "empty", "no-kv", "no-running", "negative-queue",
        "nan-running", "kv-as-percent", "negative-kv",
    ],
)
def test_bad_pages_raise_scrape_error_naming_url_and_metric(text, message, kind):
    with pytest.raises(ScrapeError) as info:
        parse(text)
    assert str(info.value) == f"{URL}: {message}"
    assert (info.value.url, info.value.kind) == (URL, kind)


def test_kv_a_rounding_hair_above_one_is_clamped_to_one():
    assert parse(BASE.replace("perc 0.0", "perc 1.0000001")).kv_usage == 1.0


def test_fractional_counts_round_to_the_nearest_integer():
    assert parse(BASE.replace("waiting 0.0", "waiting 2.6")).waiting == 3


def test_address_comes_from_previous_then_from_the_url():
    assert parse(BASE).address == "10.0.0.7:8000"
    assert parse(BASE, previous=EndpointMetrics(address="pod-a:80")).address == "pod-a:80"


def test_unknown_engine_is_a_value_error():
    with pytest.raises(ValueError, match="unknown engine 'tgi'; expected one of vllm, sglang, trtllm"):
        parse(BASE, engine="tgi")


def test_scrape_error_kinds_are_the_metric_reason_labels():
    with pytest.raises(ValueError, match="ScrapeError kind 'oops' is not one of"):
        ScrapeError(URL, "x", kind="oops")
    err = ScrapeError(URL, "missing vllm:num_requests_waiting", kind="missing-metric")
    assert repr(err) == (
        f"ScrapeError(url={URL!r}, reason='missing vllm:num_requests_waiting', "
        "kind='missing-metric')"
    )
