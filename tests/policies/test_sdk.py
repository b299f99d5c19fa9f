"""The SDK's ABI handling, exercised through every built-in policy: bad input is an
error with a message naming what was wrong — never a trap — and layouts that grew at
the end are still read."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import wasmtime
from policy_payloads import PolicyCallError, ep, post, pre, score_input, snap

from epick import abi
from epick.config import BUILTIN_POLICY_DIR
from epick.policies_build import discover
from epick.runtime import PolicyTrap

POOL = snap([
    ep("a:1", waiting=3, running=2, kv_usage=0.5, running_adapters=("x",), waiting_adapters=("y",), max_lora=2),
    ep("b:1", waiting=0, running=7, kv_usage=0.1, max_lora=1, num_gpu_blocks=100, block_size=16),
], version=1, timestamp_ms=1_000)
REQUEST = dict(request_id="r1", model="m", adapter="x", prompt="p" * 200, criticality=0, seed=7,
               cache_salt="s", headers={"k": "v"})

def _exports(name: str) -> frozenset[str]:
    wasm = (BUILTIN_POLICY_DIR / f"{name}.wasm").read_bytes()
    return frozenset(e.name for e in wasmtime.Module(wasmtime.Engine(), wasm).exports)


#: Every policy under policies/ (discovered, so one an author adds is checked too).
EXPORTS = {p.name: _exports(p.name) for p in discover()
           if (BUILTIN_POLICY_DIR / f"{p.name}.wasm").is_file()}
#: policy -> its request-path export (a filter policy's filter, else score)
INPUTS = {name: "filter" if "filter" in ex else "score" for name, ex in EXPORTS.items()}


def call(inst, export: str, blob: bytes):
    if export in ("score", "filter"):
        return getattr(inst, export)(blob, 2)
    return getattr(inst, export)(blob)


def payloads(name: str) -> dict[str, bytes]:
    """Every valid input this policy takes, by export."""
    out = {INPUTS[name]: score_input(POOL, **REQUEST)}
    if "set_snapshot" in EXPORTS[name]:
        out["set_snapshot"] = abi.encoder.encode(POOL)
    if "pre_request" in EXPORTS[name]:
        out["pre_request"] = pre("a:1", 5, **REQUEST)
    if "post_response" in EXPORTS[name]:
        out["post_response"] = post("a:1", 6, request_id="r1", adapter="x")
    return out


def test_every_discovered_policy_with_a_build_is_exercised():
    unbuilt = {p.name for p in discover()} - set(INPUTS)
    assert not unbuilt, f"no host/builtin/*.wasm for {sorted(unbuilt)}: run `make policies`"
    assert INPUTS["legacy-v1"] == "filter" and INPUTS["load"] == "score"


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_every_truncation_of_a_valid_input_is_an_error_not_a_trap(policy, name):
    inst = policy(name)
    for export, blob in payloads(name).items():
        call(inst, export, blob)  # the whole input is fine
        for cut in range(len(blob)):
            with pytest.raises(PolicyCallError):
                call(inst, export, blob[:cut])


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_random_bytes_never_trap(policy, name):
    inst = policy(name)
    rng = random.Random(name)
    refused = accepted = 0
    for export, blob in payloads(name).items():
        for _ in range(150):
            garbage = bytearray(blob)
            for _ in range(rng.randint(1, 6)):  # flip bytes of a valid input
                garbage[rng.randrange(len(garbage))] = rng.randrange(256)
            for candidate in (bytes(garbage), rng.randbytes(rng.randint(1, 64))):
                try:
                    call(inst, export, candidate)
                    accepted += 1
                except PolicyCallError:
                    refused += 1
                except PolicyTrap as exc:  # pragma: no cover - the failure being tested
                    pytest.fail(f"{name}.{export} trapped on {candidate!r}: {exc}")
    # every call ended as an answer or an error (none trapped), and the garbage did reach
    # the error path
    assert refused + accepted == 300 * len(payloads(name)) and refused > 0


def grown(value, depth_marker="future"):
    """The same payload with an unknown element appended to every array layout."""
    if isinstance(value, list):
        return [grown(v) for v in value] + [{"added-in": depth_marker}]
    return value


def test_unknown_trailing_elements_are_skipped(policy):
    plain = msgspec.to_builtins(abi.ScoreInput(snapshot=POOL, request=abi.Request(**REQUEST), candidates=(0, 1)))
    # grow the layouts (ScoreInput, Snapshot, each EndpointMetrics, Request), not the lists
    snapshot, request, candidates, in_flight, since, blocks, matched, cleared, uncached = plain
    snapshot = [*snapshot[:3], [[*e, 99] for e in snapshot[3]], "snapshot-extra"]
    request = [*request, ["request", "extra"]]
    future = msgspec.msgpack.encode([snapshot, request, candidates, in_flight, since, blocks,
                                     matched, cleared, uncached, {"score-input": "extra"}])
    for name in INPUTS:
        inst = policy(name)
        export = INPUTS[name]
        expected = call(inst, export, score_input(POOL, **REQUEST))
        np.testing.assert_array_equal(call(policy(name), export, future), expected)


def test_missing_trailing_elements_take_the_abi_defaults(policy):
    inst = policy("load", work_weight=0)
    short = msgspec.msgpack.encode([[1, 1, 0, [["a:1", 4], ["b:1"]]], ["r"], [0, 1]])
    np.testing.assert_allclose(inst.score(short, 2), [0.5, 1.0])


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (score_input(None, candidates=[0]),
         "ScoreInput.snapshot is nil but no snapshot was set (call set_snapshot first)"),
        (score_input(POOL, candidates=[0, 7]), "candidates[1] = 7 is out of range for a snapshot of 2 endpoints"),
        (msgspec.msgpack.encode([[1, 1, 0, [[5]]], [], []]),
         "expected str for snapshot.endpoints[].address, got int at byte 7"),
        (msgspec.msgpack.encode([[2, 1, 0, []], [], []]), "snapshot.schema is 2; this policy reads schema 1"),
        (msgspec.msgpack.encode([None, []]), "ScoreInput has 2 elements; needs [snapshot, request, candidates]"),
        (score_input(POOL) + b"\x00", f"1 unexpected bytes after the ScoreInput at byte {len(score_input(POOL))}"),
        (b"", "truncated input reading ScoreInput at byte 0 of 0"),
        # the seed's tag (0xfb, -5) sits at byte 64 of this encoding
        (msgspec.msgpack.encode([msgspec.to_builtins(POOL), ["r", "m", "", "", 1, -5], []]),
         "request.seed = -5 must not be negative (byte 64)"),
    ],
    ids=["nil-without-resident", "candidate-out-of-range", "ill-typed-field", "schema", "too-short",
         "trailing-bytes", "empty", "negative-seed"],
)
def test_bad_score_input_is_reported_precisely(policy, blob, message):
    with pytest.raises(PolicyCallError) as info:
        policy("load").score(blob, 2)
    assert info.value.message == message


def test_an_unknown_param_names_the_known_ones(policy):
    from policy_payloads import PolicyLoadError

    with pytest.raises(PolicyLoadError) as info:
        policy("example-c", max_runing=3)
    assert info.value.message == "unknown param 'max_runing' (known: max_running)"


def test_numbers_in_any_msgpack_width_are_read(policy):
    import struct

    endpoint_a = b"\x94" + b"\xa1a" + b"\xcd\x01\x2c" + b"\xd0\xff" + b"\xca" + struct.pack(">f", 0.25)
    endpoint_b = b"\x94" + b"\xa1b" + b"\xce\x00\x00\x00\x64" + b"\x00" + b"\xcb" + struct.pack(">d", 0.75)
    snapshot = b"\x94\x01\x01\x00\x92" + endpoint_a + endpoint_b
    candidates = b"\x92\xcc\x00\xd3" + struct.pack(">q", 1)
    blob = b"\x93" + snapshot + b"\x90" + candidates  # the request: [] (all defaults)
    # queues 300 and 100 -> 0 and 1; kv 0.25 and 0.75 -> 0.75 and 0.25
    np.testing.assert_allclose(policy("load", work_weight=0).score(blob, 2), [0.375, 0.625])
