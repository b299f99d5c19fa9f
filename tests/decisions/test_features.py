"""Stand-in prompts built from recorded hashes score like the real prompts did."""

from __future__ import annotations

import random

from epick import abi
from epick.config import resolve_module
from epick.decisions import features
from epick.interfaces import Cycle, PoolView
from epick.runtime import WasmPolicy


def test_the_prefix_policy_scores_stand_ins_as_it_scored_the_real_prompts(runtime):
    mod = runtime.compile(resolve_module("prefix-cache").read_bytes(), name="prefix-cache")
    real, stand_in = WasmPolicy(mod, name="real"), WasmPolicy(mod, name="stand-in")
    view = PoolView.build(abi.Snapshot(version=1, timestamp_ms=1, endpoints=tuple(
        abi.EndpointMetrics(address=f"10.0.0.{i}:8000") for i in range(4))))
    rng = random.Random(5)
    systems = ["".join(rng.choice("abcdefgh ") for _ in range(700)) for _ in range(3)]
    seen = 0
    try:
        for i in range(60):
            salt = rng.choice(["", "", "tenant-a"])
            prompt = rng.choice(systems)[: rng.randint(40, 700)] + f" question {i}" * 3
            hashes = tuple(features.block_hashes("m", salt, prompt, 64, 256))
            other = features.synthetic_prompt(hashes, 64, len(prompt.encode()))
            assert len(other.encode()) == len(prompt.encode())
            a = Cycle(view=view, request=abi.Request(model="m", prompt=prompt, cache_salt=salt))
            b = Cycle(view=view, request=abi.Request(model="m", prompt=other, cache_salt=salt))
            sa, sb = real.score(a, (0, 1, 2, 3)), stand_in.score(b, (0, 1, 2, 3))
            assert sa.tolist() == sb.tolist(), i
            seen += sa.max() > 0
            ep = f"10.0.0.{i % 4}:8000"
            real.pre_request(a, ep)
            stand_in.pre_request(b, ep)
    finally:
        real.close()
        stand_in.close()
    assert seen > 20  # the prompts really shared prefixes


def test_hashes_pack_and_unpack():
    hs = [0, 1, 2**64 - 1]
    assert features.unpack_hashes(features.pack_hashes(hs)) == tuple(hs)
