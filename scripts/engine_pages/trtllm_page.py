"""Render a trtllm-serve /prometheus/metrics fixture page with TensorRT-LLM's own collector.

TensorRT-LLM's wheels are not on PyPI (only a 10 kB placeholder sdist), and its
repository snapshot is too large to fetch here, so the collector source is read from the
stored copy of `tensorrt_llm/metrics/collector.py` (see tests/pool/fixtures/README.md for
the repository, commit and what was kept) and loaded from --collector. This script then
does what `OpenAIServer` in `tensorrt_llm/serve/openai_server.py` does when
`return_perf_metrics` is on:

- `set_prometheus_multiproc_dir()` (prometheus_client multiprocess mode);
- `MetricsCollector({"model_name": <model>, "engine_type": args.backend or "unknown"})`;
- `_log_config_info_metrics()` -> `log_config_info(model_config, parallel_config,
  speculative_config, kv_cache_config)` with the dicts that method builds;
- `_iteration_stats_collector_loop()` -> `log_iteration_stats(stat)` for each iteration
  stat drained from `get_stats_async` (only with `enable_iter_perf_stats`);
- `mount_metrics()`: a `CollectorRegistry` + `MultiProcessCollector`, the
  prometheus_fastapi_instrumentator `Instrumentator` on the same registry, and
  `make_asgi_app` mounted at `/prometheus/metrics` (plain `/metrics` stays the JSON
  iteration-stats route registered before it).

The page is fetched over the ASGI app with starlette's TestClient, so the body and the
content type are what the mounted app serves.

Usage (throwaway venv: prometheus_client, fastapi==0.121.3,
"prometheus-fastapi-instrumentator<8", httpx):

    /tmp/trt/venv/bin/python scripts/engine_pages/trtllm_page.py \
        --collector /tmp/trt/trtllm_collector.py --out tests/pool/fixtures/trtllm.txt
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import tempfile
from pathlib import Path

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # an HF id, not a local dir: served as-is
BACKEND = "pytorch"  # trtllm-serve's default --backend

# What _log_config_info_metrics builds for these args (values chosen, see README).
MODEL_CONFIG = {
    "model": MODEL,
    "served_model_name": MODEL,
    "dtype": "auto",
    "quantization": "none",
    "max_model_len": "131072",
    "gpu_type": "NVIDIA H100 80GB HBM3",
}
PARALLEL_CONFIG = {
    "tensor_parallel_size": "1",
    "pipeline_parallel_size": "1",
    "context_parallel_size": "1",
    "gpu_count": "1",
}
KV_CACHE_CONFIG = {
    "enable_block_reuse": "True",
    "enable_partial_reuse": "True",
    "free_gpu_memory_fraction": "0.9",
    "cache_dtype": "auto",
}

# Iteration stats as get_stats_async yields them; only keys log_iteration_stats reads.
MAX_BLOCKS = 14500
TOKENS_PER_BLOCK = 32


def _iteration(
    *,
    active,
    queued,
    completed,
    used_blocks,
    reused,
    missed,
    hit_rate,
    ctx,
    gen,
    ctx_tokens,
    latency_ms,
):
    return {
        "numActiveRequests": active,
        "numQueuedRequests": queued,
        "numCompletedRequests": completed,
        "maxNumActiveRequests": 64,
        "iterLatencyMS": latency_ms,
        "gpuMemUsage": 73_014_444_032,
        "cpuMemUsage": 2_147_483_648,
        "pinnedMemUsage": 536_870_912,
        "maxBatchSizeStatic": 64,
        "maxBatchSizeRuntime": 64,
        "maxNumTokensRuntime": 8192,
        "kvCacheStats": {
            "maxNumBlocks": MAX_BLOCKS,
            "freeNumBlocks": MAX_BLOCKS - used_blocks,
            "usedNumBlocks": used_blocks,
            "tokensPerBlock": TOKENS_PER_BLOCK,
            "reusedBlocks": reused,
            "missedBlocks": missed,
            "cacheHitRate": hit_rate,
        },
        "inflightBatchingStats": {
            "numContextRequests": ctx,
            "numGenRequests": gen,
            "numPausedRequests": 0,
            "numScheduledRequests": ctx + gen,
            "numCtxTokens": ctx_tokens,
            "avgNumDecodedTokensPerIter": 1.0,
        },
    }


ITERATIONS = [
    _iteration(
        active=4,
        queued=2,
        completed=1,
        used_blocks=5200,
        reused=310,
        missed=720,
        hit_rate=0.30,
        ctx=1,
        gen=3,
        ctx_tokens=1024,
        latency_ms=21.4,
    ),
    # The last drained stat is what the gauges show: queue 3, running 5, KV 0.42.
    _iteration(
        active=5,
        queued=3,
        completed=1,
        used_blocks=6090,
        reused=402,
        missed=858,
        hit_rate=0.319,
        ctx=1,
        gen=4,
        ctx_tokens=2048,
        latency_ms=24.9,
    ),
]


# Two finished requests (res.metrics_dict -> log_request_metrics_dict in
# OpenAIServer._extract_metrics); the stats loop only drains after a request finishes.
REQUESTS = [
    dict(
        finished_reason="stop",
        e2e=2.84,
        ttft=0.112,
        tpot=0.0213,
        request_queue_time=0.0,
        prefill_time=0.108,
        decode_time=2.72,
        inference_time=2.83,
        prompt_tokens=512,
        generation_tokens=128,
    ),
    dict(
        finished_reason="length",
        e2e=5.61,
        ttft=0.38,
        tpot=0.0204,
        request_queue_time=0.27,
        prefill_time=0.11,
        decode_time=5.22,
        inference_time=5.33,
        prompt_tokens=2048,
        generation_tokens=256,
    ),
]


def _load_collector(path: Path):
    spec = importlib.util.spec_from_file_location("trtllm_collector", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MetricsCollector, module.MetricNames


def _metrics_dict(names, request: dict) -> dict:
    # finished_reason is a plain string key; the timings are keyed by MetricNames members.
    out = {"finished_reason": request["finished_reason"]}
    for key, value in request.items():
        if key != "finished_reason":
            out[names[key.upper()]] = value
    return out


def render(collector_path: Path) -> tuple[str, str, str]:
    # set_prometheus_multiproc_dir(): a fresh TemporaryDirectory, before prometheus_client.
    tmp = tempfile.TemporaryDirectory(prefix="trtllm-prom-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tmp.name
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry, make_asgi_app, multiprocess
    from prometheus_fastapi_instrumentator import Instrumentator
    from starlette.routing import Mount

    MetricsCollector, MetricNames = _load_collector(collector_path)
    collector = MetricsCollector({"model_name": MODEL, "engine_type": BACKEND})
    collector.log_config_info(
        model_config=MODEL_CONFIG,
        parallel_config=PARALLEL_CONFIG,
        speculative_config=None,
        kv_cache_config=KV_CACHE_CONFIG,
    )
    for request, stat in zip(REQUESTS, ITERATIONS):
        collector.log_request_metrics_dict(_metrics_dict(MetricNames, request))
        collector.log_iteration_stats(stat)

    app = FastAPI()

    async def get_iteration_stats():  # the JSON /metrics route, registered first
        return JSONResponse(content=ITERATIONS[-1:])

    app.add_api_route("/metrics", get_iteration_stats, methods=["GET"])
    # Same calls and arguments as OpenAIServer.mount_metrics.
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    Instrumentator(
        should_group_status_codes=False,
        should_respect_env_var=True,
        excluded_handlers=[".*"],
        registry=registry,
    ).add().instrument(app).expose(app)
    metrics_route = Mount("/prometheus/metrics", make_asgi_app(registry=registry))
    metrics_route.path_regex = re.compile("^/prometheus/metrics(?P<path>.*)$")
    app.routes.append(metrics_route)

    with TestClient(app) as client:
        prom = client.get("/prometheus/metrics")
        prom.raise_for_status()
        plain = client.get("/metrics")
        plain.raise_for_status()
    tmp.cleanup()
    return prom.text, prom.headers["content-type"], plain.headers["content-type"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collector", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    opts = parser.parse_args()
    text, prom_type, json_type = render(opts.collector)
    opts.out.write_text(text)
    print(f"{opts.out.name}: {len(text.splitlines())} lines")
    print(f"/prometheus/metrics content-type: {prom_type}")
    print(f"/metrics content-type: {json_type}")


if __name__ == "__main__":
    main()
