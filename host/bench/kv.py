"""KV-event routing costs, measured in one run (issue 16):

    epick bench kv [--events 100000] [--json results/kv/kv.json]

1. tokenize + hash per 1 k-token prompt: the tiny model's own tokenizer (the committed
   copy in tests/kv/fixtures/tiny-llama) and the simulator's bytes tokenizer, vLLM's
   sha256 block hash at block size 16 and 32, and a whole cold ``KvRouting.counts`` for 2
   candidates (what one Pick with a new prompt pays) next to a warm one (same prompt);
2. index memory per 10 k blocks (tracemalloc, 100 k blocks in one endpoint's index);
3. events/s one process absorbs: real ZMQ, a PUB thread replaying real vLLM payloads
   (tests/kv/fixtures/vllm_events.json, BlockStored of 12 blocks + token ids) as fast as it
   can, the subscriber on the asyncio loop; meanwhile a ticker task measures how long the
   loop was held (what a Pick would have waited), and decode+apply alone for reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import threading
import time
import tracemalloc

import zmq

from epick import abi
from epick.bench import checkout
from epick.bench.timing import per_call_us
from epick.kv.events import BlockStored, KVEventBatch, decode_batch
from epick.kv.hashing import BlockHasher
from epick.kv.index import KvIndex
from epick.kv.routing import KvRouting
from epick.kv.subscriber import EventSource, KvSubscriber
from epick.kv.tokenize import BytesTokenizer, HfTokenizer


def prompt_of(tok, n_tokens: int) -> str:
    words = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima "
             "mike 17 november 42 oscar papa quebec romeo sierra tango").split()
    out, i = [], 0
    while True:
        out.append(words[i % len(words)] + ("," if i % 5 == 0 else ""))
        i += 1
        if i % 50 == 0 and len(tok.encode_prompt(" ".join(out))) >= n_tokens:
            return " ".join(out)


def bench_cost(rounds: int) -> dict:
    hf = HfTokenizer(checkout.path("tests", "kv", "fixtures", "tiny-llama"))
    by = BytesTokenizer()
    hasher = BlockHasher()
    text = prompt_of(hf, 1000)
    toks = hf.encode_prompt(text)
    btext = "x" * 4000  # 1000 bytes-tokens
    btoks = by.encode_prompt(btext)
    res: dict = {"hf_tokens": len(toks), "bytes_tokens": len(btoks)}
    calls = 20
    res["hf_tokenize_us"] = per_call_us(lambda: hf.encode_prompt(text), rounds, calls, warmup=20)
    res["bytes_tokenize_us"] = per_call_us(lambda: by.encode_prompt(btext), rounds, calls,
                                           warmup=20)
    for bs in (16, 32):
        res[f"sha256_hash_bs{bs}_us"] = per_call_us(lambda bs=bs: hasher.block_hashes(toks, bs),
                                                    rounds, calls, warmup=20)
    idx = KvIndex(100_000)
    eps = (abi.EndpointMetrics(address="a:1", block_size=32),
           abi.EndpointMetrics(address="b:1", block_size=32))
    idx.clear("a:1")
    idx.clear("b:1")
    counter = iter(range(10**9))

    def cold():
        # A new prompt each call (a distinct leading word): tokenize + hash + 2 lookups.
        r = KvRouting(idx, hf, hasher)
        r.counts(abi.Request(prompt=f"w{next(counter)} " + text), eps, (0, 1))

    warm_r = KvRouting(idx, hf, hasher)
    req = abi.Request(prompt=text)
    res["counts_cold_2cand_us"] = per_call_us(cold, rounds, calls, warmup=20)
    res["counts_warm_2cand_us"] = per_call_us(lambda: warm_r.counts(req, eps, (0, 1)),
                                              rounds, calls * 10, warmup=20)
    return res


def bench_memory() -> dict:
    n = 100_000
    stored = [KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=list(range(i * 16 + 2**62, (i + 1) * 16 + 2**62)), parent_block_hash=None,
        token_ids=[], block_size=32, lora_id=None, medium="GPU", lora_name=None)])
        for i in range(n // 16)]
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = KvIndex(n)
    for b in stored:
        idx.apply("a:1", b)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert idx.size("a:1") == n
    return {"blocks": n, "bytes": used, "bytes_per_10k_blocks": used * 10_000 // n}


def bench_absorb(n: int) -> dict:
    cap = json.loads(checkout.path("tests", "kv", "fixtures", "vllm_events.json").read_text())
    payloads = [bytes.fromhex(f["payload"]) for f in cap["frames"]]
    # The frames that store blocks (the clear would empty the index on every lap).
    payloads = [p for p in payloads
                if all(isinstance(e, BlockStored) for e in decode_batch(p).events)]
    ev_per = [len(decode_batch(p).events) for p in payloads]
    blocks_per = [sum(len(e.block_hashes) for e in decode_batch(p).events) for p in payloads]
    # decode + apply alone (no sockets)
    idx = KvIndex(200_000)
    t0 = time.perf_counter()
    m = 0
    for i in range(n):
        idx.apply("a:1", decode_batch(payloads[i % len(payloads)]))
        m += 1
    direct_s = time.perf_counter() - t0

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(1_000_000)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    topic = b"kv@bench"

    async def main() -> dict:
        import anyio

        index = KvIndex(200_000)
        sub = KvSubscriber(index, lora_discovery=False)
        sub.set_endpoints([EventSource("a:1", f"tcp://127.0.0.1:{port}", "", topic.decode())])
        gaps: list[float] = []
        async with anyio.create_task_group() as tg:
            await tg.start(sub.run)
            seq = 0
            # join: publish until the subscriber has seen something
            while sub.stats()["a:1"].batches == 0:
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payloads[0]))
                seq += 1
                await anyio.sleep(0.01)
            start_batches = sub.stats()["a:1"].batches
            first = seq

            def flood():
                for i in range(n):
                    s = first + i
                    pub.send_multipart((topic, s.to_bytes(8, "big"), payloads[i % len(payloads)]))

            th = threading.Thread(target=flood)
            t0 = time.perf_counter()
            th.start()
            last = time.perf_counter()
            while sub.stats()["a:1"].batches - start_batches < n and sub.stats()["a:1"].gaps == 0:
                await asyncio.sleep(0)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                if now - t0 > 300:
                    break
            elapsed = time.perf_counter() - t0
            th.join()
            st = sub.stats()["a:1"]
            tg.cancel_scope.cancel()
        gaps.sort()
        got = st.batches - start_batches
        return {"batches": got, "gaps": st.gaps, "seconds": elapsed,
                "loop_hold_p50_ms": gaps[len(gaps) // 2] * 1000,
                "loop_hold_p99_ms": gaps[int(len(gaps) * 0.99)] * 1000,
                "loop_hold_max_ms": gaps[-1] * 1000}

    zres = asyncio.run(main())
    pub.close(0)
    ctx.term()
    mean_ev = statistics.mean(ev_per)
    mean_blocks = statistics.mean(blocks_per)
    return {
        "payload_bytes_mean": statistics.mean(len(p) for p in payloads),
        "events_per_batch": mean_ev, "blocks_per_batch": mean_blocks,
        "direct_batches_per_s": m / direct_s,
        "direct_blocks_per_s": m * mean_blocks / direct_s,
        "zmq_batches_per_s": zres["batches"] / zres["seconds"],
        "zmq_events_per_s": zres["batches"] * mean_ev / zres["seconds"],
        "zmq_blocks_per_s": zres["batches"] * mean_blocks / zres["seconds"],
        **{f"zmq_{k}": v for k, v in zres.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick bench kv", description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=100_000, help="batches to flood")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)
    out = {"cost": bench_cost(args.rounds), "memory": bench_memory(),
           "absorb": bench_absorb(args.events)}
    c = out["cost"]
    print(f"tokenize+hash, {c['hf_tokens']}-token prompt (median / p10 / p90 us):")
    for k in ("hf_tokenize_us", "bytes_tokenize_us", "sha256_hash_bs16_us", "sha256_hash_bs32_us",
              "counts_cold_2cand_us", "counts_warm_2cand_us"):
        med, p10, p90 = c[k]
        print(f"  {k:24s} {med:9.1f} {p10:9.1f} {p90:9.1f}")
    m = out["memory"]
    print(f"index memory: {m['bytes']} B for {m['blocks']} blocks = "
          f"{m['bytes_per_10k_blocks'] / 1024:.0f} KiB per 10k blocks")
    a = out["absorb"]
    print(f"absorb ({a['blocks_per_batch']:.1f} blocks/batch, {a['payload_bytes_mean']:.0f} B):"
          f" decode+apply {a['direct_batches_per_s']:.0f} batches/s; over ZMQ "
          f"{a['zmq_batches_per_s']:.0f} batches/s = {a['zmq_blocks_per_s']:.0f} blocks/s "
          f"({a['zmq_batches']} batches, {a['zmq_gaps']} gaps, {a['zmq_seconds']:.2f} s); "
          f"loop held p50 {a['zmq_loop_hold_p50_ms']:.2f} ms, p99 "
          f"{a['zmq_loop_hold_p99_ms']:.2f} ms, max {a['zmq_loop_hold_max_ms']:.2f} ms")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
