"""The C SDK (policies/sdk/epick.h) reads what the Zig SDK does: each candidate's values
after `candidates` (uncached tokens, in flight, prefix blocks...; epick_read_score_input_values)
and the PostResponseEvent's TTFT and token counts (epick_read_post_response). A C policy
built here scores by them and exports the last completion it saw."""

from __future__ import annotations

import msgspec
import pytest
from policy_payloads import PolicyCallError, ep, post, snap

from epick import abi
from epick.policies_build import Policy, build

SOURCE = r"""
#include "epick.h"

#define MAX 64
static epick_endpoint endpoints[MAX];
static uint32_t candidates[MAX];
static int64_t in_flight[MAX], since[MAX], blocks[MAX], matched[MAX], cleared[MAX], uncached[MAX];
static epick_post_response last;
static char last_id[32];
static uint8_t state[128];

EPICK_STANDARD_EXPORTS

EPICK_EXPORT(init) int32_t init(const uint8_t *params, uint32_t len) {
    (void)params; (void)len;
    last.ttft_ms = -1.0; last.prompt_tokens = -1; last.completion_tokens = -1;
    return 0;
}

/* score = 1 / (1 + uncached / 100); unknown uncached: 1 / (1 + prompt_tokens / 100);
 * each candidate's other values are checked against what the test sent. */
EPICK_EXPORT(score) int32_t score(const uint8_t *in, uint32_t len, double *out) {
    uint32_t n_eps, n;
    epick_request q;
    epick_candidate_values v = { in_flight, since, blocks, matched, cleared, uncached };
    int32_t rc = epick_read_score_input_values(in, len, endpoints, MAX, &n_eps, &q, candidates, MAX, &n, &v);
    if (rc) return rc;
    for (uint32_t i = 0; i < n; i++) {
        int64_t u = uncached[i] >= 0 ? uncached[i] : q.prompt_tokens;
        out[i] = 1.0 / (1.0 + (double)u / 100.0);
        if (in_flight[i] != (int64_t)i || since[i] != 0 || blocks[i] != -1 || matched[i] != -1 || cleared[i] != 0)
            return epick_fail("unexpected per-candidate values", 0, 0);
    }
    return 0;
}

EPICK_EXPORT(post_response) int32_t post_response(const uint8_t *in, uint32_t len) {
    int32_t rc = epick_read_post_response(in, len, &last);
    if (rc) return rc;
    uint32_t k = last.request_id.len < sizeof last_id ? last.request_id.len : sizeof last_id;
    for (uint32_t i = 0; i < k; i++) last_id[i] = last.request_id.ptr[i];
    last.request_id.ptr = last_id; /* the input buffer is the host's to reuse */
    last.request_id.len = k;
    return 0;
}

static uint32_t put_be(uint8_t *p, uint64_t v) {
    for (int i = 7; i >= 0; i--) { *p++ = (uint8_t)(v >> (i * 8)); }
    return 8;
}

/* [ttft_ms (float64), prompt_tokens, completion_tokens, status, request_id] */
EPICK_EXPORT(export_state) int32_t export_state(void) {
    uint32_t at = 0;
    uint64_t bits;
    state[at++] = 0x95;
    state[at++] = 0xcb;
    __builtin_memcpy(&bits, &last.ttft_ms, 8);
    at += put_be(state + at, bits);
    state[at++] = 0xd3; at += put_be(state + at, (uint64_t)last.prompt_tokens);
    state[at++] = 0xd3; at += put_be(state + at, (uint64_t)last.completion_tokens);
    state[at++] = 0xd3; at += put_be(state + at, (uint64_t)last.status);
    state[at++] = (uint8_t)(0xa0 | last.request_id.len);
    for (uint32_t i = 0; i < last.request_id.len; i++) state[at++] = (uint8_t)last.request_id.ptr[i];
    epick_output = state;
    epick_output_size = at;
    return 0;
}
"""


def _build_c(tmp_path_factory, runtime, name: str, source: str):
    tmp = tmp_path_factory.mktemp(name)
    folder = tmp / name
    folder.mkdir()
    (folder / "policy.c").write_text(source)
    wasm = build(Policy(name, folder, "c"), tmp / "out").read_bytes()
    return runtime.compile(wasm, name=name)


@pytest.fixture(scope="module", params=[2, 1], ids=["abi2", "abi1"])
def c_module(request, tmp_path_factory, runtime):
    """The policy above built for ABI version 2 (the default) and version 1."""
    prefix = "#define EPICK_ABI_VERSION 1\n" if request.param == 1 else ""
    mod = _build_c(tmp_path_factory, runtime, f"c-values-{request.param}", prefix + SOURCE)
    assert mod.abi_version == request.param
    return mod


COUNTING = r"""
#define EPICK_PRE_REQUEST pre_request
#include "epick.h"

#define MAX 16
static epick_endpoint endpoints[MAX];
static uint32_t candidates[MAX];
static int32_t events;

EPICK_STANDARD_EXPORTS

EPICK_EXPORT(init) int32_t init(const uint8_t *params, uint32_t len) {
    (void)params; (void)len;
    events = 0;
    return 0;
}

/* Every pre_request event counted (a carried one too); an empty one is an error. */
EPICK_EXPORT(pre_request) int32_t pre_request(const uint8_t *in, uint32_t len) {
    (void)in;
    if (len < 2) return epick_fail("empty event", 0, 0);
    events++;
    return 0;
}

EPICK_EXPORT(score) int32_t score(const uint8_t *in, uint32_t len, double *out) {
    uint32_t n_eps, n;
    epick_request q;
    int32_t rc = epick_read_score_input(in, len, endpoints, MAX, &n_eps, &q, candidates, MAX, &n);
    if (rc) return rc;
    for (uint32_t i = 0; i < n; i++) out[i] = (double)events / 100.0;
    return 0;
}
"""


def test_a_c_policy_gets_the_event_the_next_score_carries(tmp_path_factory, runtime):
    from epick.interfaces import Cycle, PoolView
    from epick.runtime import WasmPolicy

    mod = _build_c(tmp_path_factory, runtime, "c-counting", COUNTING)
    assert mod.abi_version == 2
    plugin = WasmPolicy(mod, {}, checkpoint_on_hooks=False)
    view = PoolView.build(snap([ep("a:1"), ep("b:1")]))
    for k in range(3):
        c = Cycle(view=view, request=abi.Request(model="m"))
        assert plugin.score(c, (0, 1)).tolist() == [k / 100] * 2
        plugin.pre_request(c, "a:1")
        assert plugin.supervisor.instance.pending


def score_blob(uncached=(), **request):
    eps = snap([ep("a:1"), ep("b:1"), ep("c:1")])
    return abi.encoder.encode(abi.ScoreInput(
        snapshot=eps, request=abi.Request(model="m", **request), candidates=(0, 1, 2),
        in_flight=(0, 1, 2), uncached_tokens=tuple(uncached)))


def test_a_c_policy_reads_each_candidates_uncached_tokens(c_module):
    inst = c_module.instantiate({})
    got = inst.score(score_blob((100, -1, 0), prompt_tokens=300), 3)
    assert got.tolist() == pytest.approx([0.5, 0.25, 1.0])
    # No KV events (empty): every candidate is unknown, estimated from the prompt.
    assert inst.score(score_blob(prompt_tokens=100), 3).tolist() == pytest.approx([0.5] * 3)


def test_a_c_policy_refuses_a_per_candidate_array_of_the_wrong_length(c_module):
    inst = c_module.instantiate({})
    with pytest.raises(PolicyCallError, match="uncached_tokens"):
        inst.score(score_blob((1, 2)), 3)


def test_a_c_policy_reads_the_completions_ttft_and_token_counts(c_module):
    inst = c_module.instantiate({})
    assert msgspec.msgpack.decode(inst.export_state()) == [-1.0, -1, -1, 0, ""]
    inst.post_response(post("a:1", request_id="r7", status=1, ttft_ms=123.5, prompt_tokens=640,
                            completion_tokens=12))
    assert msgspec.msgpack.decode(inst.export_state()) == [123.5, 640, 12, 1, "r7"]
    # An event from before the fields (six elements) keeps the "not reported" defaults.
    old = msgspec.msgpack.encode(["r8", "", "a:1", 0, 5, "m"])
    inst.post_response(old)
    assert msgspec.msgpack.decode(inst.export_state()) == [-1.0, -1, -1, 0, "r8"]
