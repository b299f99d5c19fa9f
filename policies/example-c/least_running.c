/* example-c — a policy in C: prefer endpoints with fewer running requests.
 *
 *   score = 1 − min(running, max_running) / max_running
 *
 * Params: `max_running` (int > 0, default 256). Copy this directory to start a C policy;
 * policies/README.md walks through building, checking and hot-loading it.
 */
#include "epick.h"

#define MAX_ENDPOINTS 4096

static int64_t max_running = 256;
static epick_endpoint endpoints[MAX_ENDPOINTS];
static uint32_t candidates[MAX_ENDPOINTS];

EPICK_STANDARD_EXPORTS

/* describe: a msgpack map, written once into static memory. */
static const uint8_t describe_bytes[] = {
    0x84,
    0xa4, 'n', 'a', 'm', 'e', 0xa9, 'e', 'x', 'a', 'm', 'p', 'l', 'e', '-', 'c',
    0xa7, 'v', 'e', 'r', 's', 'i', 'o', 'n', 0xa5, '1', '.', '0', '.', '0',
    0xa4, 'k', 'i', 'n', 'd', 0xa6, 'c', 'u', 's', 't', 'o', 'm',
    0xa6, 'p', 'a', 'r', 'a', 'm', 's', 0x81,
    0xab, 'm', 'a', 'x', '_', 'r', 'u', 'n', 'n', 'i', 'n', 'g', 0xcd, 0x01, 0x00,
};

EPICK_EXPORT(describe) int32_t describe(void) {
    epick_output = describe_bytes;
    epick_output_size = sizeof describe_bytes;
    return 0;
}

EPICK_EXPORT(init) int32_t init(const uint8_t *params, uint32_t len) {
    epick_reader r = epick_reader_of(params, len);
    int64_t value = 256;
    uint32_t n = epick_read_map(&r, "params (a map)");
    for (uint32_t i = 0; i < n && !r.err; i++) {
        epick_str key = epick_read_str(&r, "a param name");
        if (r.err) break;
        if (epick_str_eq(key, "max_running")) {
            if (r.p < r.end && (*r.p == 0xca || *r.p == 0xcb || (*r.p >= 0xa0 && *r.p <= 0xbf)))
                return epick_fail("param 'max_running': expected an int", 0, 0);
            value = epick_read_int(&r, "param 'max_running'");
            if (!r.err && value <= 0) return epick_fail("param 'max_running': must be > 0", 0, 0);
        } else {
            return epick_fail3("unknown param '", key.ptr, key.len, "' (known: max_running)");
        }
    }
    if (r.err) return epick_fail("bad params: ", r.err, epick__cstrlen(r.err));
    max_running = value;
    return 0;
}

EPICK_EXPORT(score) int32_t score(const uint8_t *in, uint32_t len, double *out) {
    uint32_t n_eps, n_cands;
    epick_request request;
    int32_t rc = epick_read_score_input(in, len, endpoints, MAX_ENDPOINTS, &n_eps, &request, candidates,
                                        MAX_ENDPOINTS, &n_cands);
    if (rc) return rc;
    for (uint32_t i = 0; i < n_cands; i++) {
        int64_t running = endpoints[candidates[i]].running;
        if (running < 0) running = 0;
        if (running > max_running) running = max_running;
        out[i] = 1.0 - (double)running / (double)max_running;
    }
    return 0;
}
