"""ABI version 2 in the runtime: score frames, and pre_request events carried by the next
score call — flushed before anything else reaches the instance, so a policy's state is
what version 1's order gives."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from wat_modules import snapshot, wasm

from epick import abi
from epick.interfaces import Cycle, PluginError, PoolView
from epick.runtime import PolicyCallError, WasmPolicy
from epick.runtime.frame import ARRAY_SOURCES, frame_for

ADDR = "10.0.0.1:8000"


def cycle(n: int = 3, *, view: PoolView | None = None, prompt: str = "") -> Cycle:
    view = view or PoolView.build(snapshot(n))
    return Cycle(view=view, request=abi.Request(model="m", prompt=prompt))


def state(policy: WasmPolicy) -> tuple[int, int, int]:
    """(events applied, set_snapshot calls, events that rode on a score) of counter2."""
    return struct.unpack("<iii", policy.export_state())


@pytest.fixture
def counter2(runtime, fake_clock):
    def make(**kw) -> WasmPolicy:
        mod = runtime.compile(wasm("counter2"), name="counter2")
        return WasmPolicy(mod, {}, clock=fake_clock, now_ms=lambda: 42, **kw)

    return make


def test_a_version_2_module_is_loaded_as_version_2(runtime):
    mod = runtime.compile(wasm("counter2"), name="counter2")
    assert mod.abi_version == 2
    assert mod.for_vetting().abi_version == 2
    assert mod.instantiate().abi_version == 2
    assert runtime.compile(wasm("counter"), name="counter").abi_version == 1


def test_pre_request_rides_on_the_next_score(counter2):
    plugin = counter2(checkpoint_on_hooks=False)
    view = PoolView.build(snapshot(3))
    plugin.score(cycle(view=view), (0, 1, 2))
    plugin.pre_request(cycle(view=view), ADDR)
    inst = plugin.supervisor.instance
    assert inst.pending
    # the next pick's score sees the event applied first: one crossing for both
    assert plugin.score(cycle(view=view), (0, 1, 2)).tolist() == [0.001] * 3
    assert not inst.pending
    assert state(plugin) == (1, 1, 1)


def test_every_other_call_delivers_a_pending_event_first(counter2):
    plugin = counter2(checkpoint_on_hooks=False)
    c = cycle()
    plugin.score(c, (0, 1, 2))
    plugin.pre_request(c, ADDR)
    plugin.pre_request(c, ADDR)  # a second event: the first gets its own call
    assert state(plugin) == (2, 1, 0)  # export_state flushed the second
    plugin.pre_request(c, ADDR)
    plugin.post_response(abi.PostResponseEvent(request_id="r"))
    assert not plugin.supervisor.instance.pending
    plugin.pre_request(c, ADDR)
    assert plugin.describe().name == "counter2"
    assert not plugin.supervisor.instance.pending
    plugin.pre_request(c, ADDR)
    plugin.score(cycle(view=PoolView.build(snapshot(3, version=2))), (0, 1, 2))  # set_snapshot first
    assert state(plugin) == (5, 2, 0)


def test_the_scores_and_state_equal_version_1_order(counter2, runtime, fake_clock):
    v1 = WasmPolicy(runtime.compile(wasm("counter"), name="counter"), {}, clock=fake_clock,
                    now_ms=lambda: 42, checkpoint_on_hooks=False)
    v2 = counter2(checkpoint_on_hooks=False)
    views = [PoolView.build(snapshot(4, version=v)) for v in (1, 1, 2, 2, 2, 3)]
    for view in views:
        c = cycle(view=view)
        assert v1.score(c, (0, 1, 2, 3)).tolist() == v2.score(c, (0, 1, 2, 3)).tolist()
        v1.pre_request(c, ADDR)
        v2.pre_request(c, ADDR)
    assert struct.unpack("<ii", v1.export_state()) == state(v2)[:2]


def test_a_carried_event_that_fails_is_a_pre_request_failure_and_the_score_stands(counter2):
    plugin = counter2(checkpoint_on_hooks=False)
    view = PoolView.build(snapshot(3))
    plugin.score(cycle(view=view), (0, 1, 2))
    plugin.pre_request(cycle(view=view, prompt="x" * 2500), ADDR)  # the event fails (status 2)
    scores = plugin.score(cycle(view=view), (0, 1, 2))
    assert scores.tolist() == [0.0] * 3  # scored without it, by the call made again
    assert plugin.supervisor.breaker("pre_request").consecutive == 1
    assert plugin.supervisor.breaker("score").consecutive == 0
    assert plugin.stats.errors == 1
    assert state(plugin) == (0, 1, 0)


def test_a_flushed_event_that_fails_is_kept_for_the_owner(counter2):
    plugin = counter2(checkpoint_on_hooks=False)
    plugin.score(cycle(), (0, 1, 2))
    plugin.pre_request(cycle(prompt="x" * 2500), ADDR)
    inst = plugin.supervisor.instance
    inst.flush()
    exc = inst.take_deferred_failure()
    assert isinstance(exc, PolicyCallError)
    assert (exc.export, exc.status, exc.message) == ("pre_request", 1, "event too long")
    assert inst.take_deferred_failure() is None


def test_a_carried_event_that_traps_names_the_export_and_the_instance_is_recreated(counter2):
    plugin = counter2(checkpoint_on_hooks=False)
    view = PoolView.build(snapshot(3))
    plugin.score(cycle(view=view), (0, 1, 2))
    plugin.pre_request(cycle(view=view, prompt="x" * 5000), ADDR)
    with pytest.raises(PluginError) as err:
        plugin.score(cycle(view=view), (0, 1, 2))
    assert err.value.stage == "score" and err.value.kind == "trap"
    assert "score (carrying pre_request) trapped" in err.value.reason
    assert plugin.stats.recoveries == 1
    assert plugin.score(cycle(), (0, 1, 2)).tolist() == [0.0] * 3


def test_a_version_2_instance_takes_msgpack_from_tools_by_framing_it(runtime):
    inst = runtime.compile(wasm("counter2"), name="counter2").instantiate()
    blob = abi.encoder.encode(abi.ScoreInput(snapshot=snapshot(3), request=abi.Request(),
                                             candidates=(0, 1, 2)))
    assert inst.score(blob, 3).tolist() == [0.0] * 3
    with pytest.raises(PolicyCallError) as err:
        inst.score(b"\xc1", 1)
    assert err.value.detail.startswith("score not called: the host cannot frame this ScoreInput")


def test_the_frame_layout_is_the_documented_one():
    req = abi.encoder.encode(abi.Request(model="m"))
    snap = abi.encoder.encode(snapshot(3))
    frame = abi.encode_frame(req, snap, (2, 0, 1), ((5, 6, 7), (), (), (-1, 3, -1), (), ()))
    head = struct.unpack_from("<8I", frame)
    assert head == (3, len(abi.FRAME_ARRAYS), 0b1001, len(req), len(snap), 0, 0, 0)
    assert struct.unpack_from("<3I", frame, 32) == (2, 0, 1)  # then 4 bytes of padding
    assert struct.unpack_from("<6q", frame, 48) == (5, 6, 7, -1, 3, -1)
    assert frame[96:] == req + snap
    with pytest.raises(ValueError, match="in_flight has 2 values for 3 candidates"):
        abi.encode_frame(req, None, (0, 1, 2), ((1, 2), (), (), (), (), ()))


def test_the_frame_carries_every_score_input_array_and_is_made_once_per_pick():
    assert tuple(ARRAY_SOURCES) == abi.FRAME_ARRAYS
    assert abi.FRAME_ARRAYS == abi.ScoreInput.__struct_fields__[3:]
    assert set(abi.FRAME_EMPTY) == set(abi.FRAME_ARRAYS)
    c = cycle()
    cands = (0, 1, 2)
    a = frame_for(c, cands, inline_snapshot=False)
    assert frame_for(c, cands, inline_snapshot=False) is a
    b = frame_for(c, cands, inline_snapshot=True)
    assert b is not a and len(b) == len(a) + len(c.view.encoded)
    assert frame_for(c, cands, inline_snapshot=False) is a
    expected = abi.frame_from_score_input(c.score_input(cands, inline_snapshot=True))
    assert b == expected


def test_a_frame_with_a_wrong_count_of_scores_is_still_caught(runtime):
    inst = runtime.compile(wasm("counter2"), name="counter2").instantiate()
    frame = abi.encode_frame(abi.encoder.encode(abi.Request()), None, (0, 1, 2),
                             ((),) * len(abi.FRAME_ARRAYS))
    scores, ok = inst.score_frame(frame, 3)
    assert ok and np.array_equal(scores, np.zeros(3))


def test_a_carried_failure_says_which_call_carried_it(counter2):
    plugin = counter2(checkpoint_on_hooks=False)
    view = PoolView.build(snapshot(3))
    plugin.score(cycle(view=view), (0, 1, 2))
    plugin.pre_request(cycle(view=view, prompt="x" * 2500), ADDR)
    inst = plugin.supervisor.instance
    inst.score_frame(frame_for(cycle(view=view), (0, 1), inline_snapshot=False), 2)
    exc = inst.take_deferred_failure()
    assert exc.detail == "pre_request (carried by score) failed: event too long"
    assert (exc.export, exc.status, exc.message) == ("pre_request", 2, "event too long")
