"""Modules built against ABI version 1 keep working beside version 2 builds.

``v1/`` holds builds of the shipped policies made before ABI version 2 (main at
149966e, Zig SDK 1): they load as version 1, pass conformance, and give the same scores,
keep-masks and state as today's version 2 builds over one stream of picks, whose
``pre_request`` events a version 2 build receives with the next pick's call.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from epick import abi
from epick.conformance import check
from epick.interfaces import Cycle, PoolView
from epick.runtime import WasmPolicy

V1 = Path(__file__).parent / "v1"
OLD = ("prefix-cache", "lora-affinity", "legacy-v1", "example-c")


@pytest.fixture(scope="module")
def v1(runtime):
    return {name: runtime.compile((V1 / f"{name}.wasm").read_bytes(), name=name) for name in OLD}


def _snapshot(n: int, version: int) -> abi.Snapshot:
    return abi.Snapshot(version=version, timestamp_ms=1_700_000_000_000 + 1000 * version, endpoints=tuple(
        abi.EndpointMetrics(
            address=f"10.0.0.{i}:8000", waiting=(i * 7 + version) % 5, running=(i * 3 + version) % 9,
            kv_usage=((i * 13 + version) % 10) / 10, running_adapters=(f"lora{i % 3}",),
            max_lora=2, num_gpu_blocks=1000, block_size=16)
        for i in range(n)))


def _requests(count: int):
    for k in range(count):
        yield abi.Request(
            request_id=f"r{k}", model="m", adapter=f"lora{k % 4}" if k % 3 else "",
            prompt=f"system prompt {k % 5} " * 20 + f"user {k}", seed=k * 7919,
            prompt_tokens=100 + k)


@pytest.mark.parametrize("name", OLD)
def test_a_v1_build_loads_as_version_1_and_todays_build_as_version_2(v1, shipped, name):
    assert v1[name].abi_version == 1
    assert shipped(name).abi_version == 2


@pytest.mark.parametrize("n", [8, 64])
@pytest.mark.parametrize("name", OLD)
def test_v1_and_v2_builds_decide_alike_over_a_stream_of_picks(v1, shipped, name, n):
    old = WasmPolicy(v1[name], {}, now_ms=lambda: 1, checkpoint_on_hooks=False)
    new = WasmPolicy(shipped(name), {}, now_ms=lambda: 1, checkpoint_on_hooks=False)
    assert old.capabilities == new.capabilities
    views = {}
    for k, request in enumerate(_requests(60)):
        version = 1 + k // 7
        view = views.get(version) or views.setdefault(version, PoolView.build(_snapshot(n, version)))
        cands = tuple(i for i in range(n) if (i + k) % 5) if k % 2 else tuple(range(n))
        cycles = [Cycle(view=view, request=request, now_ms=1_700_000_000_000 + k) for _ in "ab"]
        if "score" in new.module.exports:
            a, b = old.score(cycles[0], cands), new.score(cycles[1], cands)
            assert a.tolist() == b.tolist(), f"pick {k}"
            picked = cands[int(a.argmax())]
        else:
            a, b = old.filter(cycles[0], cands), new.filter(cycles[1], cands)
            assert a == b, f"pick {k}"
            picked = (a or cands)[0]
        if "pre_request" in new.module.exports:
            for policy, c in zip((old, new), cycles):
                policy.pre_request(c, view.addresses[picked])
        if k % 4 == 3 and "post_response" in new.module.exports:
            event = abi.PostResponseEvent(request_id=f"r{k - 2}", adapter=request.adapter,
                                          endpoint=view.addresses[picked], ttft_ms=40.0 + k)
            old.post_response(event)
            new.post_response(event)
    assert old.export_state() == new.export_state()
    assert old.stats.errors == new.stats.errors == 0


@pytest.mark.parametrize("name", ["prefix-cache", "example-c"])
def test_a_v1_build_passes_conformance(v1, name):
    report = check(v1[name], {})
    assert report.passed, [(c.name, c.why) for c in report.cases if c.verdict != "pass"]
