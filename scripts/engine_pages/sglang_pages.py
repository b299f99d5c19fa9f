"""Render SGLang /metrics fixture pages with SGLang's own released metrics code.

Runs `sglang.srt.observability.metrics_collector.SchedulerMetricsCollector` from
the unzipped sglang 0.5.23 wheel, the way a real server does: prometheus_client in
multiprocess mode (PROMETHEUS_MULTIPROC_DIR), one scheduler process per data-parallel
rank, each `publish()`ing real `ServerArgs` and building its collector with
`SchedulerMetricsCollector.init_new`, then `emit_constants` + `log_stats`; the parent
renders the page with `MultiProcessCollector` + `generate_latest`, exactly as
`sglang.srt.utils.common.add_prometheus_middleware` serves `/metrics`.

Usage (see tests/pool/fixtures/README.md; needs the throwaway venv from
scripts/engine_pages/sglang_venv.sh, not the project's .venv):

    HF_HUB_OFFLINE=1 /tmp/sgl/venv/bin/python scripts/engine_pages/sglang_pages.py \
        --sglang-root /tmp/sgl --out tests/pool/fixtures
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import types
from pathlib import Path
from types import SimpleNamespace

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# Geometry of an 8B model on one 80 GB GPU (numbers chosen, not measured; see README).
MAX_TOTAL_TOKENS = 462_848
CONTEXT_LEN = 131_072


def _import_sglang(root: str) -> None:
    # sglang/__init__.py pulls the whole frontend (flashinfer, lang API); the metrics
    # code only needs sglang.srt.*, so register the package without running it.
    pkg = types.ModuleType("sglang")
    pkg.__path__ = [os.path.join(root, "sglang")]
    sys.modules["sglang"] = pkg


def _fake_model_dir(root: str) -> str:
    # ServerArgs resolution reads config.json; a Llama-3.1-8B-shaped config, no weights.
    path = os.path.join(root, "fake-llama-3.1-8b")
    if not os.path.exists(os.path.join(path, "config.json")):
        from transformers import LlamaConfig

        cfg = LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=CONTEXT_LEN,
        )
        cfg.architectures = ["LlamaForCausalLM"]
        cfg.save_pretrained(path)
    return path


def _reqs(by_priority: dict) -> list:
    # QueueCount.from_reqs only reads `.priority`.
    return [SimpleNamespace(priority=p) for p, n in by_priority.items() for _ in range(n)]


def _scheduler(root: str, multiproc_dir: str, args: dict, dp_rank, ticks: list) -> None:
    """One scheduler process: publish, build the collector, emit constants, log ticks."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = multiproc_dir
    _import_sglang(root)
    from sglang.srt import runtime_context as rc
    from sglang.srt.observability.metrics_collector import (
        QueueCount,
        SchedulerMetricsCollector,
        SchedulerStats,
    )
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=_fake_model_dir(root), **args)
    rc.publish(
        server_args,
        role="scheduler",
        ranks=rc.SpawnRanks(world_rank=0, dp_rank=dp_rank, gpu_id=dp_rank or 0),
    )
    prio = bool(server_args.enable_priority_scheduling)
    ctx = SchedulerMetricsCollector.init_new(
        server_args=server_args,
        enable_priority_scheduling=prio,
        enable_lora=bool(server_args.enable_lora),
        enable_hierarchical_cache=False,
    )
    collector = ctx.collector
    page_size = server_args.page_size
    # Same call and arithmetic as Scheduler.emit_metrics_constants (scheduler.py:1282).
    collector.emit_constants(
        max_total_num_tokens=MAX_TOTAL_TOKENS,
        max_total_num_tokens_swa=None,
        weight_memory_usage_gb=14.99,
        kv_cache_memory_usage_gb=56.5,
        graph_memory_usage_gb={"decode": 0.62},
        max_running_requests_under_SLO=None,
        page_size=page_size,
        num_pages=MAX_TOTAL_TOKENS // page_size,
        context_len=CONTEXT_LEN,
        startup_available_gpu_memory_gb=78.4,
    )
    for tick in ticks:
        stats = SchedulerStats()
        stats.num_running_reqs = QueueCount.from_reqs(_reqs(tick["running"]), prio)
        stats.num_queue_reqs = QueueCount.from_reqs(_reqs(tick["queue"]), prio)
        usage = tick["token_usage"]
        used = int(MAX_TOTAL_TOKENS * usage)
        evictable = tick.get("evictable", 61_440)
        stats.token_usage = stats.full_token_usage = usage
        stats.num_used_tokens = stats.kv_used_tokens = used
        stats.kv_evictable_tokens = evictable
        stats.kv_available_tokens = MAX_TOTAL_TOKENS - used - evictable
        stats.gen_throughput = tick.get("gen_throughput", 0.0)
        stats.cache_hit_rate = tick.get("cache_hit_rate", 0.0)
        stats.utilization = tick.get("utilization", 0.0)
        stats.new_token_ratio = tick.get("new_token_ratio", 0.0)
        if "lora_active" in tick:
            # Same as MetricsReporter._update_lora_metrics (metrics_reporter.py:1270).
            total = server_args.max_loras_per_batch
            used_slots = len(set(tick["lora_active"]))
            stats.lora_pool_slots_used = used_slots
            stats.lora_pool_slots_total = total
            stats.lora_pool_utilization = used_slots / total if total > 0 else 0.0
        collector.log_stats(stats)
        for latency in tick.get("queue_times", ()):
            collector.observe_queue_time(latency)


def _tokenizer(root: str, multiproc_dir: str, args: dict, requests: list) -> None:
    """The HTTP/tokenizer process: TokenizerManager's collector and per-request calls."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = multiproc_dir
    _import_sglang(root)
    from sglang.srt import runtime_context as rc
    from sglang.srt.observability.metrics_collector import (
        TokenizerMetricsCollector,
        tokenizer_metric_labels,
    )
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=_fake_model_dir(root), **args)
    rc.publish(server_args, role="tokenizer")
    obs = rc.get_observability()
    # As TokenizerManager.init_metric_collector_watchdog (tokenizer_manager.py:835).
    collector = TokenizerMetricsCollector(
        server_args=server_args,
        labels=tokenizer_metric_labels(),
        bucket_time_to_first_token=obs.bucket_time_to_first_token,
        bucket_e2e_request_latency=obs.bucket_e2e_request_latency,
        bucket_inter_token_latency=obs.bucket_inter_token_latency,
    )
    for req in requests:
        # As TokenizerManager.collect_metrics (tokenizer_manager.py:3219): the request's
        # own priority replaces the "" default; there is no total series here.
        labels = dict(collector.labels)
        if server_args.enable_priority_scheduling and req.get("priority") is not None:
            labels["priority"] = str(req["priority"])
        collector.observe_time_to_first_token(labels, req["ttft"], stream=req["stream"])
        collector.observe_inter_token_latency(labels, req["itl"] * req["out"], req["out"])
        collector.observe_one_finished_request(
            labels,
            req["prompt"],
            req["out"],
            req["cached"],
            req["e2e"],
            False,
            {"device": req["cached"], "host": 0},
            is_streaming=req["stream"],
            time_per_output_token=req["itl"],
        )


# Finished requests the tokenizer process observed (same on every page but priority).
REQUESTS = [
    dict(priority=0, ttft=0.094, itl=0.012, prompt=512, out=128, cached=256, e2e=1.63, stream=True),
    dict(priority=5, ttft=0.41, itl=0.015, prompt=2048, out=256, cached=0, e2e=4.26, stream=False),
]

# Each page: ServerArgs kwargs, then per dp rank (None = no DP controller) the ticks.
BASE = dict(
    served_model_name=MODEL,
    device="cpu",  # no GPU here; the device is not a label and changes no metric name
    page_size=16,
    enable_metrics=True,
)
PAGES = {
    "sglang_plain.txt": (
        dict(BASE),
        {
            None: [
                dict(
                    running={None: 5},
                    queue={None: 3},
                    token_usage=0.42,
                    gen_throughput=412.7,
                    cache_hit_rate=0.31,
                    utilization=0.83,
                    new_token_ratio=0.52,
                    queue_times=[0.004, 0.018, 0.35],
                )
            ]
        },
    ),
    "sglang_priority.txt": (
        dict(BASE, enable_priority_scheduling=True, default_priority_value=0),
        {
            None: [
                # First tick: priority 10 only running; the second tick shows the
                # collector keeps every priority it has seen (a 0 series, not a gap).
                dict(running={0: 2, 10: 1}, queue={0: 1}, token_usage=0.30),
                dict(
                    running={0: 3, 5: 2},
                    queue={0: 1, 5: 2},
                    token_usage=0.42,
                    gen_throughput=412.7,
                    cache_hit_rate=0.31,
                    utilization=0.83,
                    new_token_ratio=0.52,
                    queue_times=[0.004, 0.018, 0.35],
                ),
            ]
        },
    ),
    "sglang_dp2.txt": (
        dict(BASE, dp_size=2),
        {
            0: [
                dict(
                    running={None: 5},
                    queue={None: 3},
                    token_usage=0.42,
                    gen_throughput=401.2,
                    utilization=0.81,
                )
            ],
            1: [
                dict(
                    running={None: 2},
                    queue={None: 0},
                    token_usage=0.17,
                    gen_throughput=188.9,
                    utilization=0.40,
                )
            ],
        },
    ),
    "sglang_lora.txt": (
        dict(
            BASE,
            enable_lora=True,
            max_loras_per_batch=4,
            max_lora_rank=16,
            lora_target_modules=["q_proj", "v_proj"],
        ),
        {
            None: [
                dict(
                    running={None: 5},
                    queue={None: 3},
                    token_usage=0.42,
                    # lora_id of each running request (None = base model).
                    lora_active=["sql-lora", "sql-lora", "chat-lora"],
                )
            ]
        },
    ),
}


def render(root: str, name: str, args: dict, ranks: dict) -> str:
    with tempfile.TemporaryDirectory(prefix="sgl-prom-") as multiproc_dir:
        ctx = mp.get_context("spawn")
        for dp_rank, ticks in ranks.items():
            proc = ctx.Process(target=_scheduler, args=(root, multiproc_dir, args, dp_rank, ticks))
            proc.start()
            proc.join()
            if proc.exitcode != 0:
                raise SystemExit(f"{name}: scheduler dp_rank={dp_rank} exited {proc.exitcode}")
        proc = ctx.Process(target=_tokenizer, args=(root, multiproc_dir, args, REQUESTS))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"{name}: tokenizer process exited {proc.exitcode}")
        # The parent serves /metrics like add_prometheus_middleware (utils/common.py:2843).
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=multiproc_dir)
        return generate_latest(registry).decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sglang-root", required=True, help="dir holding the unzipped wheel")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", nargs="*", help="page names to render (default: all)")
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    for name, (args, ranks) in PAGES.items():
        if opts.only and name not in opts.only:
            continue
        text = render(opts.sglang_root, name, args, ranks)
        (opts.out / name).write_text(text)
        print(f"{name}: {len(text.splitlines())} lines")


if __name__ == "__main__":
    main()
