"""The SDK's ABI handling, exercised through every built-in policy: bad input is an
error with a message naming what was wrong — never a trap — and layouts that grew at
the end are still read."""

from __future__ import annotations

import random
import struct

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
    if export == "score_frame":
        return inst.score_frame(blob, 2)[0]
    if export in ("score", "filter", "filter_frame"):
        return getattr(inst, export)(blob, 2)
    return getattr(inst, export)(blob)


def frame(snapshot: bytes | None, request: bytes, candidates=(0, 1), arrays=None, *,
          extra_arrays: int = 0) -> bytes:
    """An ABI v2 score frame from raw msgpack sections (``arrays``: FRAME_ARRAYS order;
    ``extra_arrays`` appends that many arrays a later host might send)."""
    arrays = arrays or ((),) * len(abi.FRAME_ARRAYS)
    blob = abi.encode_frame(request, snapshot, tuple(candidates), arrays)
    if not extra_arrays:
        return blob
    n = len(candidates)
    head = bytearray(blob[:32])
    words = list(struct.unpack("<8I", head))
    split = 32 + len(abi.pack_candidates(tuple(candidates))) + 8 * n * bin(words[2]).count("1")
    for k in range(extra_arrays):
        words[2] |= 1 << (words[1] + k)
    words[1] += extra_arrays
    extra = struct.pack(f"<{n * extra_arrays}q", *range(n * extra_arrays))
    return struct.pack("<8I", *words) + blob[32:split] + extra + blob[split:]


def payloads(name: str) -> dict[str, bytes]:
    """Every valid input this policy takes, by export (ABI v2: the score frame too, as
    the guest reads it)."""
    out = {INPUTS[name]: score_input(POOL, **REQUEST)}
    out[INPUTS[name] + "_frame"] = abi.frame_from_score_input(score_input(POOL, **REQUEST))
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
    # grow the layouts (Snapshot, each EndpointMetrics, Request) and the frame's arrays
    snapshot, request = plain[0], plain[1]
    snapshot = [*snapshot[:3], [[*e, 99] for e in snapshot[3]], "snapshot-extra"]
    request = [*request, ["request", "extra"]]
    future = frame(msgspec.msgpack.encode(snapshot), msgspec.msgpack.encode(request),
                   extra_arrays=2)
    for name in INPUTS:
        export = INPUTS[name]
        expected = call(policy(name), export, score_input(POOL, **REQUEST))
        np.testing.assert_array_equal(call(policy(name), f"{export}_frame", future), expected)


def test_missing_trailing_elements_take_the_abi_defaults(policy):
    inst = policy("load", work_weight=0)
    short = frame(msgspec.msgpack.encode([1, 1, 0, [["a:1", 4], ["b:1"]]]),
                  msgspec.msgpack.encode(["r"]))
    np.testing.assert_allclose(inst.score_frame(short, 2)[0], [0.5, 1.0])


REQ = msgspec.msgpack.encode(abi.Request(**REQUEST))
SNAP = abi.encoder.encode(POOL)
WHOLE = frame(SNAP, REQ)


def _patched(blob: bytes, word: int, value: int) -> bytes:
    out = bytearray(blob)
    struct.pack_into("<I", out, 4 * word, value)
    return bytes(out)


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (frame(None, REQ, (0,)),
         "the score frame has no snapshot but none was set (call set_snapshot first)"),
        (frame(SNAP, REQ, (0, 7)), "candidates[1] = 7 is out of range for a snapshot of 2 endpoints"),
        (frame(msgspec.msgpack.encode([1, 1, 0, [[5]]]), REQ),
         "expected str for snapshot.endpoints[].address, got int at byte 6"),
        (frame(msgspec.msgpack.encode([2, 1, 0, []]), REQ), "snapshot.schema is 2; this policy reads schema 1"),
        (WHOLE[:20], "score frame: 20 bytes, shorter than its 32-byte header"),
        (WHOLE + b"\x00", "score frame: 1 unexpected bytes after its sections"),
        (b"", "score frame: 0 bytes, shorter than its 32-byte header"),
        (_patched(WHOLE, 0, 1 << 20), f"score frame: {1 << 20} candidates do not fit in {len(WHOLE)} bytes"),
        (_patched(WHOLE, 2, 1 << 9), "score frame: present bits 0x200 beyond its 6 arrays"),
        (_patched(WHOLE, 3, 1 << 20), f"score frame: section 0 ({1 << 20} bytes) does not fit in {len(WHOLE)} bytes"),
        # the seed's tag (0xfb, -5) sits at byte 8 of this request section
        (frame(SNAP, msgspec.msgpack.encode(["r", "m", "", "", 1, -5])),
         "request.seed = -5 must not be negative (byte 8)"),
    ],
    ids=["nil-without-resident", "candidate-out-of-range", "ill-typed-field", "schema", "too-short",
         "trailing-bytes", "empty", "too-many-candidates", "present-bits", "section-too-long",
         "negative-seed"],
)
def test_a_bad_score_frame_is_reported_precisely(policy, blob, message):
    with pytest.raises(PolicyCallError) as info:
        policy("load").score_frame(blob, 2)
    assert info.value.message == message


def test_msgpack_the_host_cannot_frame_is_refused_before_the_call(policy):
    with pytest.raises(PolicyCallError) as info:
        policy("load").score(score_input(POOL) + b"\x00", 2)
    assert info.value.detail.startswith("score not called: the host cannot frame this ScoreInput")


def test_an_unknown_param_names_the_known_ones(policy):
    from policy_payloads import PolicyLoadError

    with pytest.raises(PolicyLoadError) as info:
        policy("example-c", max_runing=3)
    assert info.value.message == "unknown param 'max_runing' (known: max_running)"


def test_numbers_in_any_msgpack_width_are_read(policy):
    endpoint_a = b"\x94" + b"\xa1a" + b"\xcd\x01\x2c" + b"\xd0\xff" + b"\xca" + struct.pack(">f", 0.25)
    endpoint_b = b"\x94" + b"\xa1b" + b"\xce\x00\x00\x00\x64" + b"\x00" + b"\xcb" + struct.pack(">d", 0.75)
    snapshot = b"\x94\x01\x01\x00\x92" + endpoint_a + endpoint_b
    blob = frame(snapshot, b"\x90", (0, 1))  # the request: [] (all defaults)
    # queues 300 and 100 -> 0 and 1; kv 0.25 and 0.75 -> 0.75 and 0.25
    np.testing.assert_allclose(policy("load", work_weight=0).score_frame(blob, 2)[0], [0.375, 0.625])
