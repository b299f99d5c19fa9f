"""The built policies (host/builtin/*.wasm) run as plugins through the real runtime."""

from __future__ import annotations

import numpy as np
import pytest

from epick import abi
from epick.config import BUILTIN_POLICY_DIR
from epick.interfaces import Capabilities, Cycle, PoolView
from epick.runtime import WasmPolicy
from epick.runtime.validate import synthetic_snapshot

DIST = BUILTIN_POLICY_DIR
BUILT = sorted(DIST.glob("*.wasm"))


@pytest.mark.parametrize("path", BUILT, ids=lambda p: p.stem)
def test_a_built_policy_serves_a_full_cycle(runtime, path):
    plugin = WasmPolicy(runtime.compile(path.read_bytes(), name=path.stem), {})
    view = PoolView.build(synthetic_snapshot(64, adapters=True))
    request = abi.Request(request_id="r1", model="base-model", adapter="chat-lora", prompt="p" * 200)
    cycle = Cycle(view=view, request=request)
    candidates = tuple(range(64))
    if Capabilities.FILTER in plugin.capabilities:
        kept = plugin.filter(cycle, candidates)
        assert set(kept) <= set(candidates)
    if Capabilities.SCORE in plugin.capabilities:
        scores = plugin.score(cycle, candidates)
        assert scores.shape == (64,) and np.isfinite(scores).all()
        assert ((0 <= scores) & (scores <= 1)).all()
    if Capabilities.PRE_REQUEST in plugin.capabilities:
        plugin.pre_request(cycle, view.snapshot.endpoints[3].address)
    if Capabilities.POST_RESPONSE in plugin.capabilities:
        plugin.post_response(
            abi.PostResponseEvent(request_id="r1", adapter="chat-lora",
                                  endpoint=view.snapshot.endpoints[3].address, model="base-model")
        )
    if Capabilities.STATE in plugin.capabilities:
        twin = WasmPolicy(plugin.module, {})
        twin.import_state(plugin.export_state())
        if Capabilities.SCORE in plugin.capabilities:
            assert twin.score(cycle, candidates).tolist() == plugin.score(cycle, candidates).tolist()
    assert plugin.stats.errors == 0
    assert plugin.describe().name
