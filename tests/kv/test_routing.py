"""KvRouting (the scheduler's seam) and the host integration: config, ScoreInput fields,
Pick explanations through a real epick service fed by real ZMQ publishers."""

import json
import pathlib
import time

import grpc
import msgspec
import pytest
from epick_service import make_config, running
from fakes import FakeVLLM, vllm_page
from vllm_publisher import Publisher

from epick import abi
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.config import ConfigError, loads
from epick.interfaces import Cycle, PoolView
from epick.kv.events import BlockStored, KVEventBatch, decode_batch, encode_batch
from epick.kv.hashing import BlockHasher
from epick.kv.index import KvIndex
from epick.kv.routing import KvRouting
from epick.kv.service import KvEvents
from epick.kv.tokenize import BytesTokenizer, HfTokenizer

FIX = pathlib.Path(__file__).parent / "fixtures"
CAP = json.loads((FIX / "vllm_events.json").read_text())


def ep(address, block_size=32):
    return abi.EndpointMetrics(address=address, block_size=block_size)


def test_counts_from_the_real_capture():
    idx = KvIndex(10_000)
    for f in CAP["frames"]:
        idx.apply("r0:1", decode_batch(bytes.fromhex(f["payload"])))
    routing = KvRouting(idx, HfTokenizer(FIX / "tiny-llama"), BlockHasher())
    last = CAP["requests"][-1]["body"]  # the prompt sent after the reset: held
    req = abi.Request(prompt=last["prompt"])
    n = len(CAP["requests"][-1]["prompt_token_ids"]) // 32
    # Block size: its events say 32 (a wrong metric loses), unknown without either.
    endpoints = (ep("r0:1", block_size=64), ep("other:1"), ep("none:1", block_size=0))
    assert routing.counts(req, endpoints, (0, 1, 2)) == ((n, n, 0), (n, -1, -1))
    # The same text with a salt is another tenant's cache: nothing matches.
    salted = abi.Request(prompt=last["prompt"], cache_salt="x")
    assert routing.counts(salted, endpoints, (0,)) == ((n,), (0,))
    # A prefix of it matches as far as its full blocks go.
    tok = routing.tokens(last["prompt"])
    assert routing.hashes(last["prompt"], 32, "", "", "")[:3] == BlockHasher().block_hashes(
        tok[:96], 32)


def test_lora_paths_per_endpoint_win():
    idx = KvIndex(100)
    hasher = BlockHasher()
    tok = BytesTokenizer()
    prompt = "x" * 256  # 64 tokens: 2 blocks of 32
    hashes = hasher.block_hashes(tok.encode_prompt(prompt), 32, lora_name="a", lora_path="/p/a")
    idx.apply("e:1", KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=32, lora_id=1,
        medium="GPU", lora_name="a")]))
    routing = KvRouting(idx, tok, hasher, lora_paths={"a": "/wrong"})
    req = abi.Request(prompt=prompt, adapter="a")
    assert routing.counts(req, (ep("e:1"),), (0,)) == ((2,), (0,))
    routing.set_lora_paths("e:1", {"a": "/p/a"})
    assert routing.counts(req, (ep("e:1"),), (0,)) == ((2,), (2,))


def test_score_input_carries_the_counts_and_nothing_when_off():
    snap = abi.Snapshot(endpoints=(ep("a:1"), ep("b:1")))
    view = PoolView.build(snap)
    req = abi.Request(prompt="y" * 300)
    off = Cycle(view=view, request=req)
    got = msgspec.msgpack.decode(off.score_input((0, 1), inline_snapshot=False),
                                 type=abi.ScoreInput)
    assert got.prefix_blocks == () and got.prefix_matched == ()
    idx = KvIndex(100)
    idx.clear("a:1")
    on = Cycle(view=view, request=req, kv=KvRouting(idx, BytesTokenizer(), BlockHasher()))
    got = msgspec.msgpack.decode(on.score_input((0, 1), inline_snapshot=False),
                                 type=abi.ScoreInput)
    assert got.prefix_blocks == (2, 2) and got.prefix_matched == (0, -1)


def test_config_errors_name_the_key(tmp_path):
    base = 'version = 1\n[[pool.endpoints]]\naddress = "a:1"\nkv_events = "tcp://h:1"\n'
    with pytest.raises(ConfigError, match="kv_events.tokenizer is required"):
        loads(base)
    with pytest.raises(ConfigError, match=r"kv_replay 'h:2' of endpoint 'a:1' is not a ZMQ"):
        loads(base + 'kv_replay = "h:2"\n[kv_events]\ntokenizer = "bytes"\n')
    with pytest.raises(ConfigError, match="kv_replay of endpoint 'a:1' needs kv_events"):
        loads('version = 1\n[[pool.endpoints]]\naddress = "a:1"\nkv_replay = "tcp://h:2"\n')
    with pytest.raises(ConfigError, match=r"max_blocks_per_endpoint"):
        loads(base + "[kv_events]\ntokenizer = 'bytes'\nmax_blocks_per_endpoint = 0\n")
    path = tmp_path / "epick.toml"
    path.write_text(base + '[kv_events]\ntokenizer = "nope"\n')
    with pytest.raises(ConfigError, match=r"epick.toml: kv_events.tokenizer: .*nope: not a dir"):
        KvEvents.from_config(loads(path.read_text()), path)
    path.write_text(base + f'[kv_events]\ntokenizer = "{FIX / "tiny-llama"}"\n')
    kv = KvEvents.from_config(loads(path.read_text()), path)
    assert kv is not None and isinstance(kv.routing.tokenizer, HfTokenizer)
    assert KvEvents.from_config(loads("version = 1\n")) is None


def stored(hashes):
    return encode_batch(KVEventBatch(ts=0.0, data_parallel_rank=0, events=[BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=32,
        lora_id=None, medium="GPU", lora_name=None)]))


def test_pick_explanations_show_what_each_engine_holds(tmp_path):
    """A real service, two fake vLLM pages, two real ZMQ publishers (vLLM's protocol)."""
    fakes = [FakeVLLM(vllm_page(block_size=32)) for _ in range(2)]
    pubs = [Publisher(topic=f"kv@{f.address}") for f in fakes]
    try:
        config = make_config([f.address for f in fakes], tmp=tmp_path, policies=("load",))
        endpoints = [msgspec.structs.replace(e, kv_events=p.events_endpoint,
                                             kv_replay=p.replay_endpoint,
                                             kv_topic=p.topic.decode())
                     for e, p in zip(config.pool.endpoints, pubs)]
        config = msgspec.structs.replace(
            config, pool=msgspec.structs.replace(config.pool, endpoints=endpoints),
            kv_events=msgspec.convert({"tokenizer": str(FIX / "tiny-llama")},
                                      type(config.kv_events)))
        prompt = CAP["requests"][0]["body"]["prompt"]
        tokens = HfTokenizer(FIX / "tiny-llama").encode_prompt(prompt)
        hashes = BlockHasher().block_hashes(tokens, 32)
        assert len(hashes) >= 4
        # Endpoint 0 holds the first 3 blocks; published before epick starts (replayed).
        pubs[0].publish(stored(hashes[:3]))
        with running(config) as svc:
            def explain():
                resp = svc.picker.Pick(pb.PickRequest(request_id="r", model="m", prompt=prompt,
                                                      explain=True, seed=1), timeout=10)
                return {c.endpoint: (c.prefix_blocks, c.prefix_matched)
                        for c in resp.explanation.candidates}
            deadline = time.monotonic() + 20
            want = {fakes[0].address: (len(hashes), 3), fakes[1].address: (len(hashes), 0)}
            while True:
                try:
                    got = explain()
                except grpc.RpcError:
                    got = None
                if got == want or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert got == want
            pubs[1].publish(stored(hashes))  # live now: endpoint 1 holds all of it
            want[fakes[1].address] = (len(hashes), len(hashes))
            deadline = time.monotonic() + 20
            while (got := explain()) != want and time.monotonic() < deadline:
                time.sleep(0.05)
            assert got == want
            stats = svc.call(lambda: svc.service.kv.subscriber.stats())
            assert all(s.bad_frames == 0 and s.gaps == 0 for s in stats.values())
            from epick.telemetry import REGISTRY
            labels = {"endpoint": fakes[1].address}
            assert REGISTRY.get_sample_value("epick_kv_index_blocks", labels) == len(hashes)
            assert REGISTRY.get_sample_value("epick_kv_frames_total", labels) >= 1
            assert REGISTRY.get_sample_value("epick_kv_bad_frames_total", labels) == 0
    finally:
        for p in pubs:
            p.close()
        for f in fakes:
            f.stop()
