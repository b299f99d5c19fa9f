"""A tiny gateway for the real-engine tests: Pick, send to the replica, report completion."""

from __future__ import annotations

import json
import urllib.request

from epick.api.gen.epick.v1 import picker_pb2 as pb


def metrics(replica_url: str) -> str:
    with urllib.request.urlopen(f"{replica_url}/metrics", timeout=30) as resp:
        return resp.read().decode()


def counter(page: str, name: str) -> float:
    """Sum of a counter's samples on a vLLM page (e.g. vllm:prefix_cache_hits_total)."""
    total = 0.0
    for line in page.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def complete(address: str, model: str, prompt: str, max_tokens: int = 4) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{address}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def routed(svc, *, model: str, adapter: str = "", prompt: str = "hello", seed: int = 0,
           max_tokens: int = 4) -> str:
    """One request the way a gateway sends it through epick; the replica that served it."""
    served_model = adapter or model
    decision = svc.picker.Pick(pb.PickRequest(model=model, adapter=adapter, prompt=prompt,
                                              seed=seed), timeout=10)
    status = pb.ERROR
    try:
        complete(decision.endpoint, served_model, prompt, max_tokens)
        status = pb.OK
    finally:
        svc.picker.ReportCompletion(pb.CompletionReport(decision_id=decision.decision_id,
                                                        endpoint=decision.endpoint,
                                                        status=status), timeout=10)
    return decision.endpoint
