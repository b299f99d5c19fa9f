/* epick.h — the epick policy ABI (policies/ABI.md) for C, header-only.
 *
 * Build:  python -m ziglang cc -target wasm32-freestanding -O2 -nostdlib -I policies/sdk \
 *             -Wl,--no-entry -o my.wasm my.c
 * (the build driver, `python -m epick.policies_build`, does this for every C file in
 * policies/NAME/).
 *
 * What this gives a C policy:
 *   - the fixed exports: epick_abi_version, alloc, error_ptr/error_len, output_ptr/len
 *     (EPICK_STANDARD_EXPORTS — put it in exactly one .c file);
 *   - a msgpack reader with a sticky error: every read after the first failure returns
 *     0/empty and keeps the first message, so decode, then check `r.err` once — bad
 *     input becomes an error status, never a trap;
 *   - decoders for the ScoreInput / Snapshot / Request layouts into fixed arrays
 *     (unknown trailing elements skipped) with each candidate's values (in flight,
 *     uncached tokens, ...: epick_read_score_input_values), for the PostResponseEvent
 *     (TTFT, token counts: epick_read_post_response), and params-map iteration;
 *   - epick_fail(msg, detail): set the message the host reads, return status 1.
 * The policy itself defines `init` and `score` (or `filter`) with EPICK_EXPORT.
 *
 * Memory: `alloc` hands out host buffers from a bump pointer that only grows (memory.grow
 * on demand); the policy keeps its own data in static arrays. Nothing here is freed.
 */
#ifndef EPICK_H
#define EPICK_H

#include <stdint.h>
#include <stddef.h>

/* 2 (the default): `score`/`filter` read the flat score frame (policies/ABI.md, "The score
 * frame"); a policy that exports `pre_request` defines EPICK_PRE_REQUEST (below) so the
 * event a frame carries reaches it. Define EPICK_ABI_VERSION 1 before the #include for a
 * version 1 module (msgpack ScoreInput). */
#ifndef EPICK_ABI_VERSION
#define EPICK_ABI_VERSION 2
#endif
#define EPICK_EXPORT(name) __attribute__((export_name(#name), used))
/* A helper a policy may not call (the build has -Werror=unused-function). */
#define EPICK_OPTIONAL static __attribute__((unused))

/* ---- errors ----------------------------------------------------------------------- */

static char epick_err_buf[256];
static uint32_t epick_err_len;

static uint32_t epick__append(char *dst, uint32_t at, uint32_t cap, const char *s, uint32_t n) {
    for (uint32_t i = 0; i < n && at < cap; i++) dst[at++] = s[i];
    return at;
}

static uint32_t epick__cstrlen(const char *s) {
    uint32_t n = 0;
    while (s[n]) n++;
    return n;
}

/* Set the error message to `msg` ‖ `detail` (detail_len bytes, may be 0) ‖ `tail`
 * (may be 0); returns 1, the status to return. */
static int32_t epick_fail3(const char *msg, const char *detail, uint32_t detail_len, const char *tail) {
    uint32_t n = epick__append(epick_err_buf, 0, sizeof epick_err_buf, msg, epick__cstrlen(msg));
    n = epick__append(epick_err_buf, n, sizeof epick_err_buf, detail, detail_len);
    if (tail) n = epick__append(epick_err_buf, n, sizeof epick_err_buf, tail, epick__cstrlen(tail));
    epick_err_len = n;
    return 1;
}

static int32_t epick_fail(const char *msg, const char *detail, uint32_t detail_len) {
    return epick_fail3(msg, detail, detail_len, 0);
}

/* ---- memory ----------------------------------------------------------------------- */

extern unsigned char __heap_base;
static uintptr_t epick__brk;

static void *epick_bump(uint32_t len) {
    if (!epick__brk) epick__brk = (uintptr_t)&__heap_base;
    uintptr_t start = (epick__brk + 15) & ~(uintptr_t)15;
    uintptr_t end = start + len;
    uintptr_t have = __builtin_wasm_memory_size(0) * 65536u;
    if (end > have) {
        uintptr_t pages = (end - have + 65535u) / 65536u;
        if (__builtin_wasm_memory_grow(0, pages) == (size_t)-1) return 0;
    }
    epick__brk = end;
    return (void *)start;
}

/* ---- msgpack reader --------------------------------------------------------------- */

typedef struct { const uint8_t *p, *end; const char *err; } epick_reader;
typedef struct { const char *ptr; uint32_t len; } epick_str;

static epick_reader epick_reader_of(const void *buf, uint32_t len) {
    epick_reader r = { (const uint8_t *)buf, (const uint8_t *)buf + len, 0 };
    return r;
}

static int epick__need(epick_reader *r, uint32_t n, const char *what) {
    if (r->err) return 0;
    if ((uint32_t)(r->end - r->p) < n) { r->err = what; return 0; }
    return 1;
}

static uint64_t epick__be(epick_reader *r, uint32_t n, const char *what) {
    uint64_t v = 0;
    if (!epick__need(r, n, what)) return 0;
    for (uint32_t i = 0; i < n; i++) v = (v << 8) | *r->p++;
    return v;
}

static uint32_t epick__container(epick_reader *r, uint8_t fix_lo, uint8_t fix_hi, uint8_t t16, uint8_t t32, const char *what) {
    if (!epick__need(r, 1, what)) return 0;
    uint8_t t = *r->p;
    uint32_t n;
    if (t >= fix_lo && t <= fix_hi) { r->p++; n = t & 0x0f; }
    else if (t == t16) { r->p++; n = (uint32_t)epick__be(r, 2, what); }
    else if (t == t32) { r->p++; n = (uint32_t)epick__be(r, 4, what); }
    else { r->err = what; return 0; }
    /* every element takes at least a byte: a longer count is garbage */
    if (!r->err && n > (uint32_t)(r->end - r->p)) { r->err = what; return 0; }
    return n;
}

static uint32_t epick_read_array(epick_reader *r, const char *what) { return epick__container(r, 0x90, 0x9f, 0xdc, 0xdd, what); }
static uint32_t epick_read_map(epick_reader *r, const char *what) { return epick__container(r, 0x80, 0x8f, 0xde, 0xdf, what); }

EPICK_OPTIONAL int epick_read_nil(epick_reader *r) {
    if (!r->err && r->p < r->end && *r->p == 0xc0) { r->p++; return 1; }
    return 0;
}

static int64_t epick_read_int(epick_reader *r, const char *what) {
    if (!epick__need(r, 1, what)) return 0;
    uint8_t t = *r->p;
    if (t <= 0x7f) { r->p++; return t; }
    if (t >= 0xe0) { r->p++; return (int8_t)t; }
    r->p++;
    switch (t) {
    case 0xcc: return (int64_t)epick__be(r, 1, what);
    case 0xcd: return (int64_t)epick__be(r, 2, what);
    case 0xce: return (int64_t)epick__be(r, 4, what);
    case 0xcf: return (int64_t)epick__be(r, 8, what); /* u64: seeds wrap, as C does */
    case 0xd0: return (int8_t)epick__be(r, 1, what);
    case 0xd1: return (int16_t)epick__be(r, 2, what);
    case 0xd2: return (int32_t)epick__be(r, 4, what);
    case 0xd3: return (int64_t)epick__be(r, 8, what);
    }
    r->p--;
    r->err = what;
    return 0;
}

static double epick_read_float(epick_reader *r, const char *what) {
    if (!epick__need(r, 1, what)) return 0;
    uint8_t t = *r->p;
    if (t == 0xcb) {
        r->p++;
        uint64_t bits = epick__be(r, 8, what);
        double d;
        __builtin_memcpy(&d, &bits, 8);
        return d;
    }
    if (t == 0xca) {
        r->p++;
        uint32_t bits = (uint32_t)epick__be(r, 4, what);
        float f;
        __builtin_memcpy(&f, &bits, 4);
        return f;
    }
    return (double)epick_read_int(r, what);
}

static epick_str epick_read_str(epick_reader *r, const char *what) {
    epick_str s = { "", 0 };
    if (!epick__need(r, 1, what)) return s;
    uint8_t t = *r->p;
    uint32_t n;
    if (t >= 0xa0 && t <= 0xbf) { r->p++; n = t & 0x1f; }
    else if (t == 0xd9 || t == 0xc4) { r->p++; n = (uint32_t)epick__be(r, 1, what); }
    else if (t == 0xda || t == 0xc5) { r->p++; n = (uint32_t)epick__be(r, 2, what); }
    else if (t == 0xdb || t == 0xc6) { r->p++; n = (uint32_t)epick__be(r, 4, what); }
    else { r->err = what; return s; }
    if (!epick__need(r, n, what)) return s;
    s.ptr = (const char *)r->p;
    s.len = n;
    r->p += n;
    return s;
}

EPICK_OPTIONAL int epick_str_eq(epick_str s, const char *lit) {
    uint32_t n = epick__cstrlen(lit);
    if (s.len != n) return 0;
    for (uint32_t i = 0; i < n; i++) if (s.ptr[i] != lit[i]) return 0;
    return 1;
}

/* Skip one value of any type (iteratively: garbage cannot blow the stack). */
static void epick_skip(epick_reader *r, const char *what) {
    uint64_t pending = 1;
    while (pending > 0 && !r->err) {
        pending--;
        if (!epick__need(r, 1, what)) return;
        uint8_t t = *r->p;
        if ((t >= 0x80 && t <= 0x8f) || t == 0xde || t == 0xdf) pending += 2ull * epick_read_map(r, what);
        else if ((t >= 0x90 && t <= 0x9f) || t == 0xdc || t == 0xdd) pending += epick_read_array(r, what);
        else if ((t >= 0xa0 && t <= 0xbf) || (t >= 0xd9 && t <= 0xdb) || (t >= 0xc4 && t <= 0xc6)) epick_read_str(r, what);
        else if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) r->p++;
        else if (t >= 0xcc && t <= 0xd3) epick_read_int(r, what);
        else if (t == 0xca || t == 0xcb) epick_read_float(r, what);
        else r->err = what; /* ext types never occur in the ABI */
    }
}

static void epick_skip_n(epick_reader *r, uint32_t n, const char *what) {
    while (n-- > 0 && !r->err) epick_skip(r, what);
}

/* ---- ABI layouts ------------------------------------------------------------------ */

typedef struct {
    epick_str address;
    int64_t waiting, running;
    double kv_usage;
    uint32_t n_running_adapters, n_waiting_adapters; /* names skipped in the C SDK */
    int64_t max_lora, num_gpu_blocks, block_size;
} epick_endpoint;

typedef struct {
    epick_str request_id, model, adapter, prompt, cache_salt;
    int64_t criticality;
    uint64_t seed;
    /* SLOs in ms (0 = none), the prompt's tokens (count or estimate), the session key */
    int64_t slo_ttft_ms, slo_tpot_ms, prompt_tokens;
    epick_str session_id;
} epick_request;

static uint32_t epick__skip_list(epick_reader *r, const char *what) {
    uint32_t n = epick_read_array(r, what);
    epick_skip_n(r, n, what);
    return n;
}

static void epick_read_endpoint(epick_reader *r, epick_endpoint *e) {
    uint32_t n = epick_read_array(r, "snapshot.endpoints[]");
    epick_endpoint z = { { "", 0 }, 0, 0, 0.0, 0, 0, 0, 0, 0 };
    *e = z;
    if (n > 0) e->address = epick_read_str(r, "snapshot.endpoints[].address");
    if (n > 1) e->waiting = epick_read_int(r, "snapshot.endpoints[].waiting");
    if (n > 2) e->running = epick_read_int(r, "snapshot.endpoints[].running");
    if (n > 3) e->kv_usage = epick_read_float(r, "snapshot.endpoints[].kv_usage");
    if (n > 4) e->n_running_adapters = epick__skip_list(r, "snapshot.endpoints[].running_adapters");
    if (n > 5) e->n_waiting_adapters = epick__skip_list(r, "snapshot.endpoints[].waiting_adapters");
    if (n > 6) e->max_lora = epick_read_int(r, "snapshot.endpoints[].max_lora");
    if (n > 7) e->num_gpu_blocks = epick_read_int(r, "snapshot.endpoints[].num_gpu_blocks");
    if (n > 8) e->block_size = epick_read_int(r, "snapshot.endpoints[].block_size");
    if (n > 9) epick_skip_n(r, n - 9, "snapshot.endpoints[] (trailing)");
}

static void epick_read_request(epick_reader *r, epick_request *q) {
    uint32_t n = epick_read_array(r, "request");
    epick_request z = { { "", 0 }, { "", 0 }, { "", 0 }, { "", 0 }, { "", 0 }, 1, 0, 0, 0, 0, { "", 0 } };
    *q = z;
    if (n > 0) q->request_id = epick_read_str(r, "request.request_id");
    if (n > 1) q->model = epick_read_str(r, "request.model");
    if (n > 2) q->adapter = epick_read_str(r, "request.adapter");
    if (n > 3) q->prompt = epick_read_str(r, "request.prompt");
    if (n > 4) q->criticality = epick_read_int(r, "request.criticality");
    if (n > 5) q->seed = (uint64_t)epick_read_int(r, "request.seed");
    if (n > 6) q->cache_salt = epick_read_str(r, "request.cache_salt");
    if (n > 7) epick_skip(r, "request.headers");
    if (n > 8) q->slo_ttft_ms = epick_read_int(r, "request.slo_ttft_ms");
    if (n > 9) q->slo_tpot_ms = epick_read_int(r, "request.slo_tpot_ms");
    if (n > 10) q->prompt_tokens = epick_read_int(r, "request.prompt_tokens");
    if (n > 11) q->session_id = epick_read_str(r, "request.session_id");
    if (n > 12) epick_skip_n(r, n - 12, "request (trailing)");
}

/* What a ScoreInput carries per candidate after `candidates` (policies/ABI.md, elements
 * 3-8), in candidate order. Point each array you want at room for `max_cands` values (NULL:
 * skipped); a value the host did not send is the ABI's "empty" meaning: 0 for in_flight,
 * picked_since_scrape and prefix_cleared_ms, -1 (unknown) for prefix_blocks, prefix_matched
 * and uncached_tokens. uncached_tokens[i] = the prompt tokens candidate i would prefill by
 * its engine's KV-cache events (-1: unknown; estimate from request.prompt_tokens). */
typedef struct {
    int64_t *in_flight, *picked_since_scrape, *prefix_blocks, *prefix_matched,
        *prefix_cleared_ms, *uncached_tokens;
} epick_candidate_values;

EPICK_OPTIONAL void epick__read_per_candidate(epick_reader *r, int64_t *out, uint32_t n_cands, int64_t empty,
                                      const char *what) {
    uint32_t m = epick_read_array(r, what);
    if (r->err) return;
    if (m != 0 && m != n_cands) {
        r->err = what; /* neither empty nor one value per candidate */
        return;
    }
    for (uint32_t i = 0; i < m && !r->err; i++) {
        int64_t v = epick_read_int(r, what);
        if (out) out[i] = v;
    }
    if (m == 0 && out)
        for (uint32_t i = 0; i < n_cands; i++) out[i] = empty;
}

EPICK_OPTIONAL int32_t epick_read_score_input_values(const void *in, uint32_t len, epick_endpoint *eps,
                                             uint32_t max_eps, uint32_t *n_eps, epick_request *q,
                                             uint32_t *cands, uint32_t max_cands, uint32_t *n_cands,
                                             const epick_candidate_values *values);

/* Decode a ScoreInput with an inline snapshot (C policies do not export set_snapshot).
 * Returns 0, or 1 after epick_fail with a message naming what was wrong. The values per
 * candidate (uncached tokens, in flight, ...) are skipped: epick_read_score_input_values. */
EPICK_OPTIONAL int32_t epick_read_score_input(const void *in, uint32_t len, epick_endpoint *eps, uint32_t max_eps,
                                      uint32_t *n_eps, epick_request *q, uint32_t *cands, uint32_t max_cands,
                                      uint32_t *n_cands) {
    return epick_read_score_input_values(in, len, eps, max_eps, n_eps, q, cands, max_cands, n_cands, 0);
}

EPICK_OPTIONAL const int64_t epick__empty_values[6] = { 0, 0, -1, -1, 0, -1 };

/* Read a msgpack Snapshot into `eps`. */
EPICK_OPTIONAL int32_t epick__read_snapshot(epick_reader *r, epick_endpoint *eps, uint32_t max_eps, uint32_t *n_eps) {
    uint32_t sn = epick_read_array(r, "snapshot");
    if (sn > 0 && epick_read_int(r, "snapshot.schema") != 1 && !r->err) return epick_fail("snapshot.schema is not 1", 0, 0);
    if (sn > 1) epick_read_int(r, "snapshot.version");
    if (sn > 2) epick_read_int(r, "snapshot.timestamp_ms");
    *n_eps = 0;
    if (sn > 3) {
        uint32_t m = epick_read_array(r, "snapshot.endpoints");
        if (m > max_eps) return epick_fail("snapshot.endpoints: more endpoints than this policy holds", 0, 0);
        for (uint32_t i = 0; i < m && !r->err; i++) epick_read_endpoint(r, &eps[i]);
        *n_eps = m;
    }
    if (sn > 4) epick_skip_n(r, sn - 4, "snapshot (trailing)");
    return 0;
}

#if EPICK_ABI_VERSION >= 2
/* ---- ABI v2: the score frame ------------------------------------------------------ */

EPICK_OPTIONAL uint32_t epick__u32le(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

EPICK_OPTIONAL int64_t epick__i64le(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return (int64_t)v;
}

#ifdef EPICK_PRE_REQUEST
/* The policy's pre_request (EPICK_PRE_REQUEST names it): applied to the event a frame carries. */
int32_t EPICK_PRE_REQUEST(const uint8_t *in, uint32_t len);
#endif

/* epick_read_score_input, and each array of `values` (NULL: none) filled for the candidates.
 * A carried pre_request event goes to EPICK_PRE_REQUEST first; its failure returns 2 (the
 * ABI's "carried event failed": score nothing). */
EPICK_OPTIONAL int32_t epick_read_score_input_values(const void *in, uint32_t len, epick_endpoint *eps,
                                             uint32_t max_eps, uint32_t *n_eps, epick_request *q,
                                             uint32_t *cands, uint32_t max_cands, uint32_t *n_cands,
                                             const epick_candidate_values *values) {
    const uint8_t *b = (const uint8_t *)in;
    if (len < 32) return epick_fail("score frame: shorter than its 32-byte header", 0, 0);
    uint64_t n = epick__u32le(b), arrays = epick__u32le(b + 4);
    uint32_t present = epick__u32le(b + 8);
    if (arrays > 32 || (arrays < 32 && (present >> arrays) != 0)) return epick_fail("score frame: bad array count or present bits", 0, 0);
    if (n > max_cands) return epick_fail("candidates: more than this policy holds", 0, 0);
    uint64_t at = 32;
    const uint8_t *cand_at = b + at;
    uint64_t cand_bytes = (4 * n + 7) & ~(uint64_t)7;
    if (cand_bytes > len - at) return epick_fail("score frame: the candidates do not fit", 0, 0);
    at += cand_bytes;
    const uint8_t *value_at[6] = { 0, 0, 0, 0, 0, 0 };
    for (uint32_t k = 0; k < arrays; k++) {
        if (!((present >> k) & 1)) continue;
        if (8 * n > len - at) return epick_fail("score frame: a per-candidate array does not fit", 0, 0);
        if (k < 6) value_at[k] = b + at;
        at += 8 * n;
    }
    const uint8_t *part[5];
    uint32_t part_len[5];
    for (uint32_t i = 0; i < 5; i++) {
        uint64_t size = epick__u32le(b + 12 + 4 * i);
        if (size > len - at) return epick_fail("score frame: a section does not fit", 0, 0);
        part[i] = b + at;
        part_len[i] = (uint32_t)size;
        at += size;
    }
    if (at != len) return epick_fail("score frame: unexpected bytes after its sections", 0, 0);
    if (part_len[2]) {
#ifdef EPICK_PRE_REQUEST
        if (EPICK_PRE_REQUEST(part[2], part_len[2])) return 2;
        epick_err_len = 0;
#else
        epick_fail("the score frame carries a pre_request event, but this policy defines no EPICK_PRE_REQUEST", 0, 0);
        return 2;
#endif
    }
    if (!part_len[1]) return epick_fail("the score frame has no snapshot: this policy needs it inline", 0, 0);
    epick_reader r = epick_reader_of(part[1], part_len[1]);
    int32_t rc = epick__read_snapshot(&r, eps, max_eps, n_eps);
    if (rc) return rc;
    if (r.err) return epick_fail("malformed or truncated snapshot at ", r.err, epick__cstrlen(r.err));
    if (r.p != r.end) return epick_fail("unexpected bytes after the snapshot", 0, 0);
    r = epick_reader_of(part[0], part_len[0]);
    epick_read_request(&r, q);
    if (r.err) return epick_fail("malformed or truncated request at ", r.err, epick__cstrlen(r.err));
    if (r.p != r.end) return epick_fail("unexpected bytes after the request", 0, 0);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t v = epick__u32le(cand_at + 4 * i);
        if (v >= *n_eps) return epick_fail("candidates[]: index out of range", 0, 0);
        cands[i] = v;
    }
    *n_cands = (uint32_t)n;
    if (values) {
        int64_t *arrays_out[6] = { values->in_flight, values->picked_since_scrape, values->prefix_blocks,
                                   values->prefix_matched, values->prefix_cleared_ms, values->uncached_tokens };
        for (uint32_t k = 0; k < 6; k++) {
            if (!arrays_out[k]) continue;
            for (uint32_t i = 0; i < n; i++)
                arrays_out[k][i] = value_at[k] ? epick__i64le(value_at[k] + 8 * i) : epick__empty_values[k];
        }
    }
    return 0;
}

#else /* EPICK_ABI_VERSION 1: a msgpack ScoreInput */

/* epick_read_score_input, and each array of `values` (NULL: none) filled for the candidates. */
EPICK_OPTIONAL int32_t epick_read_score_input_values(const void *in, uint32_t len, epick_endpoint *eps,
                                             uint32_t max_eps, uint32_t *n_eps, epick_request *q,
                                             uint32_t *cands, uint32_t max_cands, uint32_t *n_cands,
                                             const epick_candidate_values *values) {
    epick_reader r = epick_reader_of(in, len);
    uint32_t n = epick_read_array(&r, "ScoreInput");
    if (!r.err && n < 3) return epick_fail("ScoreInput needs [snapshot, request, candidates]", 0, 0);
    if (epick_read_nil(&r)) return epick_fail("ScoreInput.snapshot is nil: this policy needs it inline", 0, 0);
    uint32_t sn = epick_read_array(&r, "snapshot");
    if (sn > 0 && epick_read_int(&r, "snapshot.schema") != 1 && !r.err) return epick_fail("snapshot.schema is not 1", 0, 0);
    if (sn > 1) epick_read_int(&r, "snapshot.version");
    if (sn > 2) epick_read_int(&r, "snapshot.timestamp_ms");
    *n_eps = 0;
    if (sn > 3) {
        uint32_t m = epick_read_array(&r, "snapshot.endpoints");
        if (m > max_eps) return epick_fail("snapshot.endpoints: more endpoints than this policy holds", 0, 0);
        for (uint32_t i = 0; i < m && !r.err; i++) epick_read_endpoint(&r, &eps[i]);
        *n_eps = m;
    }
    if (sn > 4) epick_skip_n(&r, sn - 4, "snapshot (trailing)");
    epick_read_request(&r, q);
    uint32_t c = epick_read_array(&r, "candidates");
    if (c > max_cands) return epick_fail("candidates: more than this policy holds", 0, 0);
    for (uint32_t i = 0; i < c && !r.err; i++) {
        int64_t v = epick_read_int(&r, "candidates[]");
        if (!r.err && (v < 0 || v >= (int64_t)*n_eps)) return epick_fail("candidates[]: index out of range", 0, 0);
        cands[i] = (uint32_t)v;
    }
    *n_cands = c;
    static const epick_candidate_values none = { 0, 0, 0, 0, 0, 0 };
    const epick_candidate_values *v = values ? values : &none;
    int64_t *arrays[6] = { v->in_flight, v->picked_since_scrape, v->prefix_blocks, v->prefix_matched,
                           v->prefix_cleared_ms, v->uncached_tokens };
    static const int64_t empty[6] = { 0, 0, -1, -1, 0, -1 };
    static const char *const names[6] = { "in_flight", "picked_since_scrape", "prefix_blocks",
                                          "prefix_matched", "prefix_cleared_ms", "uncached_tokens" };
    for (uint32_t k = 0; k < 6 && !r.err; k++) {
        if (n > 3 + k) epick__read_per_candidate(&r, arrays[k], c, empty[k], names[k]);
        else if (arrays[k])
            for (uint32_t i = 0; i < c; i++) arrays[k][i] = empty[k];
    }
    if (n > 9) epick_skip_n(&r, n - 9, "ScoreInput (trailing)");
    if (r.err) return epick_fail("malformed or truncated input at ", r.err, epick__cstrlen(r.err));
    if (r.p != r.end) return epick_fail("unexpected bytes after the ScoreInput", 0, 0);
    return 0;
}
#endif

/* A PostResponseEvent (policies/ABI.md): the request finished. Fields the host did not
 * send keep the ABI's defaults: ttft_ms -1.0, prompt_tokens and completion_tokens -1 (not
 * reported). */
typedef struct {
    epick_str request_id, adapter, endpoint, model;
    int64_t status; /* 0 OK, 1 ERROR, 2 CANCELLED */
    int64_t timestamp_ms;
    double ttft_ms; /* time to first token the gateway measured, ms; < 0: not reported */
    int64_t prompt_tokens, completion_tokens;
} epick_post_response;

/* Decode a PostResponseEvent. Returns 0, or 1 after epick_fail naming what was wrong. */
EPICK_OPTIONAL int32_t epick_read_post_response(const void *in, uint32_t len, epick_post_response *ev) {
    epick_reader r = epick_reader_of(in, len);
    epick_post_response z = { { "", 0 }, { "", 0 }, { "", 0 }, { "", 0 }, 0, 0, -1.0, -1, -1 };
    *ev = z;
    uint32_t n = epick_read_array(&r, "PostResponseEvent");
    if (n > 0) ev->request_id = epick_read_str(&r, "PostResponseEvent.request_id");
    if (n > 1) ev->adapter = epick_read_str(&r, "PostResponseEvent.adapter");
    if (n > 2) ev->endpoint = epick_read_str(&r, "PostResponseEvent.endpoint");
    if (n > 3) ev->status = epick_read_int(&r, "PostResponseEvent.status");
    if (n > 4) ev->timestamp_ms = epick_read_int(&r, "PostResponseEvent.timestamp_ms");
    if (n > 5) ev->model = epick_read_str(&r, "PostResponseEvent.model");
    if (n > 6) ev->ttft_ms = epick_read_float(&r, "PostResponseEvent.ttft_ms");
    if (n > 7) ev->prompt_tokens = epick_read_int(&r, "PostResponseEvent.prompt_tokens");
    if (n > 8) ev->completion_tokens = epick_read_int(&r, "PostResponseEvent.completion_tokens");
    if (n > 9) epick_skip_n(&r, n - 9, "PostResponseEvent (trailing)");
    if (r.err) return epick_fail("malformed or truncated input at ", r.err, epick__cstrlen(r.err));
    if (r.p != r.end) return epick_fail("unexpected bytes after the PostResponseEvent", 0, 0);
    return 0;
}

/* ---- the fixed exports ------------------------------------------------------------ */

static const uint8_t *epick_output;
static uint32_t epick_output_size;

#define EPICK_STANDARD_EXPORTS                                                              \
    EPICK_EXPORT(epick_abi_version) int32_t epick_abi_version(void) { return EPICK_ABI_VERSION; } \
    EPICK_EXPORT(alloc) void *alloc(uint32_t len) { return epick_bump(len); }              \
    EPICK_EXPORT(error_ptr) const char *error_ptr(void) { return epick_err_buf; }          \
    EPICK_EXPORT(error_len) uint32_t error_len(void) { return epick_err_len; }             \
    EPICK_EXPORT(output_ptr) const uint8_t *output_ptr(void) { return epick_output; }      \
    EPICK_EXPORT(output_len) uint32_t output_len(void) { return epick_output_size; }

#endif /* EPICK_H */
