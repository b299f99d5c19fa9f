"""SGLang 0.5.23 and TensorRT-LLM pages rendered by the engines' own metrics code
(tests/pool/fixtures/README.md says how, and which values were set)."""

from __future__ import annotations

from pathlib import Path

import pytest

from epick.pool import EndpointSpec
from epick.pool.parse import parse_page

FIXTURES = Path(__file__).parent / "fixtures"


def parsed(name: str, engine: str):
    return parse_page((FIXTURES / name).read_text(), engine=engine, url="u", previous=None)


@pytest.mark.parametrize("name", ["sglang_plain.txt", "sglang_priority.txt"])
def test_sglang_counts_are_the_totals_even_with_per_priority_series(name):
    # the priority page carries priority="" totals (3 queued, 5 running) AND one series
    # per priority (1 + 2 queued, 3 + 2 running): summing all would read 6 and 10
    m = parsed(name, "sglang").metrics
    assert (m.waiting, m.running, m.kv_usage) == (3, 5, 0.42)


def test_sglang_page_geometry_is_read():
    m = parsed("sglang_plain.txt", "sglang").metrics
    assert (m.block_size, m.num_gpu_blocks) == (16, 28928)


def test_sglang_data_parallel_ranks_are_summed_and_the_busiest_kv_counts():
    m = parsed("sglang_dp2.txt", "sglang").metrics
    assert (m.running, m.waiting, m.kv_usage) == (7, 3, 0.42)  # 5+2, 3+0, max(0.42, 0.17)


def test_sglang_lora_slots_are_max_lora_and_name_no_adapter():
    m = parsed("sglang_lora.txt", "sglang").metrics
    assert (m.max_lora, m.running_adapters, m.waiting_adapters) == (4, (), ())


def test_trtllm_gauges_and_geometry_are_read():
    page = parsed("trtllm.txt", "trtllm")
    m = page.metrics
    assert (m.waiting, m.running, m.kv_usage) == (3, 5, 0.42)
    assert (m.block_size, m.num_gpu_blocks) == (32, 14500)
    assert page.skipped == ()


def test_trtllm_is_scraped_where_trtllm_serve_serves_prometheus_text():
    # its /metrics is JSON iteration stats
    assert EndpointSpec(address="10.0.0.1:8000", engine="trtllm").url == (
        "http://10.0.0.1:8000/prometheus/metrics")
    assert EndpointSpec(address="10.0.0.1:8000").url == "http://10.0.0.1:8000/metrics"
