/* One call for all of a pick's scorers (docs/performance.md, "Fifth round").
 *
 * epick_score_all() runs, for each ABI v2 scorer of a pick, in the scorers' order, what
 * PolicyInstance.score_frame does around its guest call: write the score frame (and the
 * carried pre_request event, its length in the frame header) into the guest's input
 * buffer, fill the output slots with the sentinel, refill fuel, set the epoch deadline,
 * call `score` through wasmtime_func_call_unchecked, clear the event length, and read the
 * scores back (sentinel slot untouched, every score's bit pattern at most 1.0's). Then,
 * when every scorer came back clean, Σ weight × score in the scorers' order (the same
 * float operations as the scheduler's numpy loop).
 *
 * It judges nothing beyond "clean": anything else (a trap or error, a non-zero status, a
 * carried event's failure, a score out of range or missing) is left as the guest left
 * it and reported per scorer, so the host finishes that scorer with its own Python code
 * (the trap is in the GuestFunc's own trap slot, the scores in the guest's output slots).
 *
 * No Python headers: the host loads it with ctypes (CDLL, so the GIL is released for
 * the whole loop and the epoch ticker thread can interrupt a spinning guest) and hands
 * it wasmtime's C functions from wasmtime-py's own library.
 */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef void *(*call_fn)(void *ctx, void *func, void *args, size_t nargs, void **trap);
typedef void (*deadline_fn)(void *ctx, uint64_t ticks);
typedef void *(*fuel_fn)(void *ctx, uint64_t fuel);
typedef uint8_t *(*mem_data_fn)(void *ctx, void *mem);
typedef size_t (*mem_size_fn)(void *ctx, void *mem);

/* wasmtime's functions (every field 8 bytes: the ctypes Structure mirrors it). */
typedef struct {
    call_fn call;
    deadline_fn set_deadline;
    fuel_fn set_fuel;
    mem_data_fn mem_data;
    mem_size_fn mem_size;
} epick_fns;

/* One exported function of one instance, as a GuestFunc binds it. */
typedef struct {
    void *func;   /* wasmtime_func_t* */
    uint8_t *args; /* wasmtime_val_raw_t[nargs]: i32 argument k at byte 16 * k */
    void **trap;  /* the GuestFunc's trap slot */
    uint64_t nargs;
    uint64_t fuel;  /* 0: fuel off */
    uint64_t ticks;
} epick_func;

/* One scorer of the pick. */
typedef struct {
    void *ctx; /* wasmtime_context_t* */
    void *mem; /* wasmtime_memory_t* */
    epick_func plain;
    epick_func carrying; /* func NULL: the module takes no carried events */
    uint64_t in_ptr, in_cap, out_ptr, out_slots;
    uint64_t frame; /* 0: frame a, 1: frame b */
    uint64_t event_at; /* offset of the frame header's event_len */
    double weight;
} epick_scorer;

enum {
    EPICK_OK = 0,
    EPICK_TRAP = 1,         /* aux: the error pointer (the trap is in the func's slot) */
    EPICK_STATUS = 2,       /* aux: the non-zero status */
    EPICK_EVENT_FAILED = 3, /* aux: the status (the carried event failed) */
    EPICK_DIRTY = 4,        /* a score missing, out of range, or one too many */
    EPICK_LAYOUT = -1,      /* a buffer outside memory: nothing was called */
};

#define SENTINEL 0x7FF8E91C5C0E0BADULL
#define ONE_BITS 0x3FF0000000000000ULL
#define FRAME_EVENT_FAILED 2

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void put_i32(uint8_t *args, int k, uint32_t v) { memcpy(args + 16 * k, &v, 4); }

static int32_t call_one(const epick_fns *fns, void *ctx, const epick_func *f, uint64_t in_ptr,
                        uint64_t size, uint64_t out_ptr, int64_t *aux) {
    put_i32(f->args, 0, (uint32_t)in_ptr);
    put_i32(f->args, 1, (uint32_t)size);
    put_i32(f->args, 2, (uint32_t)out_ptr);
    if (f->fuel) fns->set_fuel(ctx, f->fuel);
    fns->set_deadline(ctx, f->ticks);
    void *err = fns->call(ctx, f->func, f->args, (size_t)f->nargs, f->trap);
    if (err || *f->trap) {
        *aux = (int64_t)(intptr_t)err;
        return EPICK_TRAP;
    }
    int32_t status;
    memcpy(&status, f->args, 4);
    *aux = status;
    return status ? EPICK_STATUS : EPICK_OK;
}

/* Run every scorer. events: the carried events back to back, event_lens[i] bytes for
 * scorer i (0: none). scores: k rows of n doubles, then the n totals. results: three
 * int64 per scorer (code, aux, ns). Returns how many scorers did not come back clean
 * (0: the totals are written), or EPICK_LAYOUT before any call. */
int epick_score_all(const epick_fns *fns, const epick_scorer *s, int k,
                    const uint8_t *frame_a, uint64_t len_a, const uint8_t *frame_b,
                    uint64_t len_b, const uint8_t *events, const uint32_t *event_lens,
                    uint64_t n, double *scores, int64_t *results) {
    /* Every buffer inside its memory, with room for this pick, before anything runs. */
    for (int i = 0; i < k; i++) {
        const epick_scorer *p = &s[i];
        uint64_t size = (p->frame ? len_b : len_a) + event_lens[i];
        uint64_t mem = fns->mem_size(p->ctx, p->mem);
        if (size > p->in_cap || n >= p->out_slots || p->in_ptr + p->in_cap > mem ||
            p->out_ptr + 8 * p->out_slots > mem || p->event_at + 4 > (p->frame ? len_b : len_a) ||
            (event_lens[i] && !p->carrying.func))
            return EPICK_LAYOUT;
    }
    int bad = 0;
    uint64_t ev_off = 0;
    for (int i = 0; i < k; i++) {
        const epick_scorer *p = &s[i];
        int64_t *r = results + 3 * i;
        const uint8_t *frame = p->frame ? frame_b : frame_a;
        uint64_t len = p->frame ? len_b : len_a, ev = event_lens[i];
        int64_t t0 = now_ns();
        /* Memory never moves (memory_may_move = false), but its base is read afresh. */
        uint8_t *base = fns->mem_data(p->ctx, p->mem);
        uint8_t *in = base + p->in_ptr;
        memcpy(in, frame, len);
        if (ev) {
            memcpy(in + len, events + ev_off, ev);
            uint32_t ev32 = (uint32_t)ev;
            memcpy(in + p->event_at, &ev32, 4);
        }
        ev_off += ev;
        uint64_t sentinel = SENTINEL;
        uint8_t *out = base + p->out_ptr;
        for (uint64_t j = 0; j <= n; j++) memcpy(out + 8 * j, &sentinel, 8);
        int64_t aux = 0;
        int code = call_one(fns, p->ctx, ev ? &p->carrying : &p->plain, p->in_ptr, len + ev,
                            p->out_ptr, &aux);
        base = fns->mem_data(p->ctx, p->mem);
        if (ev) memset(base + p->in_ptr + p->event_at, 0, 4);
        if (code == EPICK_STATUS && ev && aux == FRAME_EVENT_FAILED) code = EPICK_EVENT_FAILED;
        if (code == EPICK_OK) {
            out = base + p->out_ptr;
            uint64_t top = 0, last;
            double *row = scores + (uint64_t)i * n;
            for (uint64_t j = 0; j < n; j++) {
                uint64_t bits;
                memcpy(&bits, out + 8 * j, 8);
                if (bits > top) top = bits;
                memcpy(row + j, &bits, 8);
            }
            memcpy(&last, out + 8 * n, 8);
            if (last != SENTINEL || top > ONE_BITS) code = EPICK_DIRTY;
        }
        r[0] = code;
        r[1] = aux;
        r[2] = now_ns() - t0;
        bad += code != EPICK_OK;
    }
    if (bad || k == 0) return bad;
    double *totals = scores + (uint64_t)k * n;
    for (uint64_t j = 0; j < n; j++) totals[j] = s[0].weight * scores[j];
    for (int i = 1; i < k; i++) {
        const double *row = scores + (uint64_t)i * n;
        double w = s[i].weight;
        for (uint64_t j = 0; j < n; j++) totals[j] = totals[j] + w * row[j];
    }
    return 0;
}
