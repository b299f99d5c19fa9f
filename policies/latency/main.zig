//! latency — predicted TTFT and TPOT per endpoint, learned online from the completions,
//! scored by SLO headroom (docs/scoring.md, "latency"; issue 30).
//!
//! Every endpoint has two recursive-least-squares models (RLS with forgetting factor λ):
//!   TTFT (ms) ≈ θ · z,  z = overhead_ktokens + uncached/1000 + pending/1000
//!                          + work_ktokens · work + (adapter_ktokens when the request's
//!                            adapter is not listed on the endpoint)
//!   TPOT (ms) ≈ φ · [1, work]
//! where uncached = ctx.uncachedTokens(i) (the engines' KV events) or else the request's
//! prompt_tokens, pending = the uncached tokens of the requests this policy saw picked
//! for the endpoint, not yet complete, whose first token is not due yet by the TTFT
//! predicted for them at their pick (the prefill work still ahead of this one), and work = ctx.work(i) (running + waiting + unseen picks, or in flight). θ is the
//! endpoint's cost in ms per thousand tokens of prefill work: one coefficient, learnt from
//! one or two completions, positive, monotone in load. (A linear model over queue, running,
//! KV use, uncached tokens and work was tried first, per endpoint by RLS: on the
//! simulator's mixed fleet it needed tens of samples per endpoint, its coefficients swung
//! by ±10³ ms on collinear features, and it sent the slow replicas twice their share —
//! p90 TTFT 4.7–26 s against 1.8 s for the defaults alone.)
//! Predictions count a negative slope as 0: more work or more tokens never predicts a
//! faster answer, so a model fitted on a narrow range of load cannot extrapolate a busy
//! endpoint into a fast one. (Projecting the coefficients onto ≥ 0 after each update
//! instead made RLS oscillate: a fast replica's intercept reached 5 s after 15 samples of
//! 0.1 s. KV use and the queue alone were tried as features:
//! tiny, collinear with work, they took coefficients of ±10⁴ ms and steered badly.) The features a candidate had when it was
//! scored are kept for the request picked on it (pre_request) and, when its completion
//! reports a TTFT (post_response, status OK), update that endpoint's model and the fleet's
//! pooled one; a completion with ≥ 2 output tokens and a known TTFT also gives a TPOT
//! sample: (post timestamp − pre timestamp − TTFT) / (completion_tokens − 1).
//! An endpoint's own model predicts once it has `min_samples` samples; before that the
//! pooled model does (an endpoint's own model starts from the prior). Its prediction fades
//! into the pooled one as its last sample ages (`stale_ms`), and once a model has
//! `min_samples` samples a TTFT sample counts at most `outlier_ratio` times (at least
//! 1 / `outlier_ratio` of) its fitted value: on two CPU replicas one stalled request taught
//! an endpoint to be slow, it was then not picked and never learnt otherwise (issue 30's
//! real runs: 44 of 45 zero-hit requests on one replica at 2/s, 63 of 98 at 5/s).
//!
//! Score, t = max(predicted TTFT, 1 ms), p = max(predicted TPOT, 0.1 ms):
//!   no SLO:            t_min / t over the candidates (the fastest 1.0)
//!   TTFT SLO s:        t ≤ s: 0.5 + 0.5 · t_min / t;  t > s: 0.5 · s / t
//!   TPOT SLO s':       the same with p, p_min and s'; with both SLOs the smaller
//! (t_min, p_min over the candidates not held back by `probe_inflight`; those score 0).
//! An SLO no candidate is predicted to meet is dropped for that request (with a TPOT SLO
//! alone, by p_min / p; else t_min / t): the tiers would only halve the spread. A
//! candidate that meets the SLO always outranks one that misses it; among those that meet
//! it, the faster the better.
//!
//! Sessions (`Request.session_id`): "sticky until saturated" — a request of a session
//! stays on the endpoint its session was last picked for (1 there, the others' scores
//! halved) while that endpoint's predicted TTFT is within `session_penalty_ms` of the best
//! candidate's; beyond it the session lets go (scored as any request, and re-homed where
//! it is picked).
//!
//! State (export_state / import_state: hot swaps keep the model): [1, pooled TTFT model,
//! pooled TPOT model, [[address, TTFT model, TPOT model]…], [[session, address]…]], a
//! model = [n, [θ…], [P…]] (P row-major); a state without the sessions is accepted.
//! Picks awaiting their completion are not exported (a swap loses their samples, nothing
//! else).
//!
//! What a score keeps for the next one is hints that change no score (docs/quality.md,
//! "The latency policy's cost"): each snapshot slot's model (checked against the
//! candidate's address before use), an address found without a model (while no model was
//! added), each model's staleness weight for one `now` and last sample time, and which
//! endpoints of the resident snapshot list each adapter asked for (until the next
//! snapshot; an inline snapshot's lists are read per candidate).

const std = @import("std");
const sdk = @import("epick");

pub const name = "latency";
pub const version = "0.1.0";
pub const kind = "latency";
pub const panic = sdk.panic;

const inf = std.math.inf(f64);

pub const Params = struct {
    /// RLS forgetting factor: weight of a sample halves after ln 2 / (1 − λ) samples.
    forgetting: f64 = 0.97,
    /// Samples an endpoint's own model needs before it predicts (the pooled model before).
    min_samples: i64 = 2,
    /// Prior cost in ms per thousand tokens of prefill work (before any sample).
    prior_ms_per_ktoken: f64 = 100.0,
    /// A request's fixed cost (frontend, the first step), in thousands of tokens of work.
    overhead_ktokens: f64 = 0.5,
    /// Prior TPOT in ms (before any sample).
    prior_tpot_ms: f64 = 10.0,
    /// Picks in flight an endpoint may have while it has fewer than `min_samples`
    /// samples (0 = no limit): above it, it scores 0 until its completions say how fast it
    /// is. A completion comes after the whole answer, seconds on a slow replica: without
    /// the limit the fleet's early, optimistic model kept sending to it meanwhile.
    probe_inflight: i64 = 2,
    /// Picks remembered while their completion is awaited; older ones are dropped first.
    max_pending: i64 = 65536,
    /// A pick whose completion has not come after this long is forgotten.
    pending_ttl_ms: i64 = 600_000,
    /// Sessions ("sticky until saturated"): a request with a `session_id` stays on the
    /// endpoint its session was last sent to while that endpoint's predicted TTFT is at
    /// most this much above the best candidate's (then it scores 1 and the others half
    /// their score); beyond it, the session lets go and is scored like any request.
    session_penalty_ms: f64 = 200.0,
    /// Sessions remembered; beyond it the first-seen is forgotten.
    max_sessions: i64 = 65536,
    /// Each request the candidate has (`ctx.work(i)`: running, waiting, picks its page
    /// does not show yet) adds this much prefill work, in thousands of tokens, to its
    /// TTFT feature: a request in the engine slows every step a new one shares with it.
    work_ktokens: f64 = 0.02,
    /// A request for an adapter the candidate's page does not list (running or waiting)
    /// adds this much work, in thousands of tokens: the adapter load it may cost.
    adapter_ktokens: f64 = 1.0,
    /// An endpoint's own TTFT coefficient fades into the pooled one as its last sample
    /// ages: by e^(−age / stale_ms) (0 = never). An endpoint that stopped being picked
    /// (it measured slow once, perhaps by an outlier) is otherwise judged forever on what
    /// it measured then and never picked again to learn otherwise.
    stale_ms: f64 = 20000.0,
    /// Once a model has `min_samples` samples, a TTFT sample more than this many times its
    /// fitted value (or less than its fitted value over this) counts as that bound (0 = no
    /// bound): one outlier (a stalled client, a machine that went unscheduled) otherwise
    /// moves a coefficient learnt from few samples several-fold. A real change still
    /// shows, by this factor per sample.
    outlier_ratio: f64 = 3.0,

    pub fn check(p: *const Params) sdk.Error!void {
        if (!(p.forgetting > 0.5 and p.forgetting <= 1.0)) return sdk.fail("param 'forgetting': {d} is not in (0.5, 1]", .{p.forgetting});
        if (p.min_samples < 0 or p.min_samples > 1_000_000) return sdk.fail("param 'min_samples': {d} is not in [0, 1000000]", .{p.min_samples});
        if (!(p.prior_ms_per_ktoken >= 0 and p.prior_ms_per_ktoken < inf)) return sdk.fail("param 'prior_ms_per_ktoken': {d} must be a finite number >= 0", .{p.prior_ms_per_ktoken});
        if (!(p.overhead_ktokens > 0 and p.overhead_ktokens < 1e6)) return sdk.fail("param 'overhead_ktokens': {d} is not in (0, 1000000)", .{p.overhead_ktokens});
        if (!(p.prior_tpot_ms >= 0 and p.prior_tpot_ms < inf)) return sdk.fail("param 'prior_tpot_ms': {d} must be a finite number >= 0", .{p.prior_tpot_ms});
        if (p.probe_inflight < 0 or p.probe_inflight > 1 << 20) return sdk.fail("param 'probe_inflight': {d} is not in [0, 1048576]", .{p.probe_inflight});
        if (p.max_pending < 1 or p.max_pending > 1 << 20) return sdk.fail("param 'max_pending': {d} is not in [1, 1048576]", .{p.max_pending});
        if (!(p.session_penalty_ms >= 0 and p.session_penalty_ms < inf)) return sdk.fail("param 'session_penalty_ms': {d} must be a finite number >= 0", .{p.session_penalty_ms});
        if (p.max_sessions < 0 or p.max_sessions > 1 << 20) return sdk.fail("param 'max_sessions': {d} is not in [0, 1048576]", .{p.max_sessions});
        if (p.pending_ttl_ms < 1) return sdk.fail("param 'pending_ttl_ms': {d} must be >= 1", .{p.pending_ttl_ms});
        if (!(p.work_ktokens >= 0 and p.work_ktokens < 1e6)) return sdk.fail("param 'work_ktokens': {d} is not in [0, 1000000)", .{p.work_ktokens});
        if (!(p.adapter_ktokens >= 0 and p.adapter_ktokens < 1e6)) return sdk.fail("param 'adapter_ktokens': {d} is not in [0, 1000000)", .{p.adapter_ktokens});
        if (!(p.outlier_ratio == 0 or (p.outlier_ratio >= 1 and p.outlier_ratio < inf))) return sdk.fail("param 'outlier_ratio': {d} must be 0 or a finite number >= 1", .{p.outlier_ratio});
        if (!(p.stale_ms >= 0 and p.stale_ms < inf)) return sdk.fail("param 'stale_ms': {d} must be a finite number >= 0", .{p.stale_ms});
    }
};

const gpa = sdk.gpa;

/// Recursive least squares of dimension D with exponential forgetting.
fn Rls(comptime D: usize) type {
    return struct {
        const Self = @This();
        pub const dim = D;

        n: i64 = 0,
        theta: [D]f64 = @splat(0),
        p: [D * D]f64 = @splat(0),

        /// P's initial diagonal: a weak prior (coefficients free to move by ~100s of ms).
        const p0: f64 = 1.0e4;
        /// Bound on trace(P): with forgetting and features that do not vary, P grows
        /// without limit in the unexcited directions (wind-up); it is scaled back here.
        const max_trace: f64 = 1.0e6 * @as(f64, @floatFromInt(D));

        pub fn init(theta: [D]f64) Self {
            var m: Self = .{ .theta = theta };
            for (0..D) |i| m.p[i * D + i] = p0;
            return m;
        }

        /// The fitted value (learning uses it unclamped).
        pub fn fitted(m: *const Self, x: *const [D]f64) f64 {
            var y: f64 = 0;
            for (0..D) |i| y += m.theta[i] * x[i];
            return y;
        }

        /// The prediction: slope coefficients below 0 count as 0, so more work or more
        /// tokens never predicts a faster answer (a fit on a narrow range of load can take
        /// a negative slope that would extrapolate a busy endpoint into a fast one).
        pub fn predict(m: *const Self, x: *const [D]f64) f64 {
            var y: f64 = m.theta[0] * x[0];
            for (1..D) |i| y += fmax(m.theta[i], 0.0) * x[i];
            return y;
        }

        pub fn update(m: *Self, x: *const [D]f64, y: f64, lambda: f64) void {
            if (!std.math.isFinite(y)) return;
            var px: [D]f64 = undefined; // P x
            for (0..D) |i| {
                var s: f64 = 0;
                for (0..D) |j| s += m.p[i * D + j] * x[j];
                px[i] = s;
            }
            var denom: f64 = lambda;
            for (0..D) |i| denom += x[i] * px[i];
            if (!(denom > 1e-12) or !std.math.isFinite(denom)) return;
            const err = y - m.fitted(x);
            for (0..D) |i| m.theta[i] += px[i] / denom * err;
            // P = (P − P x xᵀ P / denom) / λ   (P symmetric: xᵀ P = (P x)ᵀ)
            var trace: f64 = 0;
            for (0..D) |i| {
                for (0..D) |j| {
                    m.p[i * D + j] = (m.p[i * D + j] - px[i] * px[j] / denom) / lambda;
                }
                trace += m.p[i * D + i];
            }
            if (trace > max_trace) {
                const k = max_trace / trace;
                for (&m.p) |*v| v.* *= k;
            }
            m.n +|= 1;
        }

        pub fn write(m: *const Self, w: *sdk.Writer) sdk.Error!void {
            try w.arrayHeader(3);
            try w.int(m.n);
            try w.arrayHeader(D);
            for (m.theta) |v| try w.float(v);
            try w.arrayHeader(D * D);
            for (m.p) |v| try w.float(v);
        }

        pub fn read(r: *sdk.Reader, comptime what: []const u8) sdk.Error!Self {
            var m: Self = .{};
            try fixedArray(r, what, 3);
            m.n = try r.int(what ++ " n");
            if (m.n < 0) return sdk.fail(what ++ " n is {d}", .{m.n});
            try fixedArray(r, what ++ " theta", D);
            for (&m.theta) |*v| v.* = try finite(r, what ++ " theta[]");
            try fixedArray(r, what ++ " P", D * D);
            for (&m.p) |*v| v.* = try finite(r, what ++ " P[]");
            return m;
        }
    };
}

/// `@min` of two floats as wasm32 builds it (compiler_rt's fmin: NaN loses, −0 < +0),
/// inline: the call to compiler_rt per candidate cost more than the comparison.
inline fn fmin(x: f64, y: f64) f64 {
    if (std.math.isNan(x)) return y;
    if (std.math.isNan(y)) return x;
    if (std.math.signbit(x) != std.math.signbit(y)) return if (std.math.signbit(x)) x else y;
    return if (x < y) x else y;
}

/// `@max` of two floats as compiler_rt's fmax computes it (NaN loses, +0 > −0), inline.
inline fn fmax(x: f64, y: f64) f64 {
    if (std.math.isNan(x)) return y;
    if (std.math.isNan(y)) return x;
    if (std.math.signbit(x) != std.math.signbit(y)) return if (std.math.signbit(x)) y else x;
    return if (x < y) y else x;
}

fn finite(r: *sdk.Reader, comptime what: []const u8) sdk.Error!f64 {
    const v = try r.float(what);
    if (!std.math.isFinite(v)) return sdk.fail(what ++ " is not finite", .{});
    return v;
}

fn fixedArray(r: *sdk.Reader, comptime what: []const u8, n: u32) sdk.Error!void {
    const got = try r.arrayLen(what);
    if (got != n) return sdk.fail(what ++ " has {d} elements, not {d}", .{ got, n });
}

const Ttft = Rls(1);
const Tpot = Rls(2);

const Model = struct {
    ttft: Ttft,
    tpot: Tpot,
    /// When its last TTFT sample came (the host's ms; 0 = none since this instance
    /// started or imported it: not exported).
    last_ms: i64 = 0,
    /// The staleness weight e^(−(now − last_ms) / stale_ms) last computed, for `w_now`
    /// and `w_last` (picks in the same host millisecond reuse it: the same float).
    w: f64 = 1.0,
    w_now: i64 = 0,
    w_last: i64 = 0,
};

const Features = struct {
    ttft: [Ttft.dim]f64,
    tpot: [Tpot.dim]f64,
    /// The request's uncached tokens there (pending work once it is picked).
    tokens: i64,
    /// The TTFT predicted for it there, ms (how long its prefill stays ahead of others).
    predicted_ms: f64 = 0,
};

const Pending = struct {
    /// Its endpoint's index in `models` (entries are never removed while it is pending;
    /// the address is that entry's key).
    model: u32,
    f: Features,
    at_ms: i64,
    /// Its entry in `ahead_list` (unique per remembered pick).
    seq: u64,
};

/// A pending pick whose first token may not be due yet: due = at_ms + predicted_ms.
const Ahead = struct { due: f64, seq: u64, model: u32, tokens: i64 };

const state_format: i64 = 1;

var cfg: Params = .{};
var pooled: Model = undefined;
/// Per endpoint address (owned keys), in first-seen order (an export is deterministic).
var models: std.StringArrayHashMapUnmanaged(Model) = .empty;
/// Per request id (owned keys), in pick order.
var pending: std.StringArrayHashMapUnmanaged(Pending) = .empty;
var latest_ms: i64 = 0;
// What `pendingLoad` needs, kept as picks come and go so a score does not walk every
// pending pick (thousands in flight on a big fleet: ~5 µs a score per thousand):
/// Per model index: its pending picks.
var pick_count: std.ArrayList(i64) = .empty;
/// The pending picks not due yet at `ahead_now` (any order); a score drops those due by
/// its `now`, or rebuilds the list from `pending` when its `now` is earlier.
var ahead_list: std.ArrayList(Ahead) = .empty;
var ahead_now: f64 = -inf;
var next_seq: u64 = 0;
/// Session id -> the endpoint it was last picked for (owned keys and values), first-seen order.
var sessions: std.StringArrayHashMapUnmanaged([]u8) = .empty;
/// Per snapshot endpoint index (a candidate's `ctx.candidates[i]`): what the last lookup
/// of its address found. A hint only, used when it still holds for the candidate's
/// address, else the address is looked up by hash (a string hash per candidate and pick
/// was most of this policy's own time).
var slots: std.ArrayList(Slot) = .empty;

/// Per adapter name asked for since the resident snapshot came: which of its endpoints
/// (a bit per snapshot index) list the adapter, running or waiting. Only read for a
/// resident snapshot (`ctx.resident`: the same endpoints until the next `onSnapshot`,
/// which empties it); an inline one is checked per candidate.
var adapter_bits: std.StringHashMapUnmanaged([]u64) = .empty;
/// Adapter names kept per snapshot; a request for another is checked per candidate.
const max_adapter_bits = 1024;

const Slot = struct {
    /// 1 + the index in `models` of the address last looked up here (0 = none found).
    model: u32 = 0,
    /// With `model` 0: `models.count()` when `absent` was found to have no model (models
    /// only grow until `clearState`, so it still has none while the count is the same).
    absent_at: u32 = std.math.maxInt(u32),
    absent: std.ArrayList(u8) = .empty,
};

// The last `score` call: its request id and each candidate's features, so that the
// pre_request that follows it records what the picked candidate looked like.
var last_id: std.ArrayList(u8) = .empty;
/// Each candidate's index in `models` (`no_model`: none yet; its address is then in
/// `last_bytes`). A model's key is its address, kept as long as the model: copying 64
/// addresses a score cost more than all of its predictions.
var last_model: std.ArrayList(u32) = .empty;
const no_model = std.math.maxInt(u32);
/// The addresses of the candidates without a model, back to back in one reused buffer
/// (no allocation per call): candidate i's is last_bytes[last_end[i-1]..last_end[i]]
/// (empty for a candidate with a model).
var last_bytes: std.ArrayList(u8) = .empty;
var last_end: std.ArrayList(u32) = .empty;
var last_feat: std.ArrayList(Features) = .empty;

fn priorTtft() [Ttft.dim]f64 {
    return .{cfg.prior_ms_per_ktoken};
}

fn priorTpot() [Tpot.dim]f64 {
    return .{ cfg.prior_tpot_ms, 0 };
}

fn clearState() void {
    for (models.keys()) |k| gpa.free(k);
    models.clearAndFree(gpa);
    for (pending.keys()) |k| gpa.free(k);
    pending.clearAndFree(gpa);
    for (slots.items) |*s| s.absent.deinit(gpa);
    slots.clearAndFree(gpa);
    pick_count.clearAndFree(gpa);
    ahead_list.clearAndFree(gpa);
    ahead_now = -inf;
    for (sessions.keys(), sessions.values()) |k, v| {
        gpa.free(k);
        gpa.free(v);
    }
    sessions.clearAndFree(gpa);
    clearAdapterBits();
    clearLast();
    latest_ms = 0;
    pooled = .{ .ttft = Ttft.init(priorTtft()), .tpot = Tpot.init(priorTpot()) };
}

fn clearAdapterBits() void {
    var it = adapter_bits.iterator();
    while (it.next()) |kv| {
        gpa.free(kv.key_ptr.*);
        gpa.free(kv.value_ptr.*);
    }
    adapter_bits.clearRetainingCapacity();
}

/// A new pool view: the adapter lists found on the last one no longer hold.
pub fn onSnapshot(snap: *const sdk.Snapshot) sdk.Error!void {
    _ = snap;
    clearAdapterBits();
}

/// Which endpoints of the resident snapshot `snap` list `adapter` (running or waiting),
/// found once per snapshot and name; null past `max_adapter_bits` names.
fn adapterBits(snap: *const sdk.Snapshot, adapter: []const u8) sdk.Error!?[]const u64 {
    if (adapter_bits.get(adapter)) |b| return b;
    if (adapter_bits.count() >= max_adapter_bits) return null;
    try adapter_bits.ensureUnusedCapacity(gpa, 1);
    const bits = try gpa.alloc(u64, @max((snap.endpoints.len + 63) / 64, 1));
    errdefer gpa.free(bits);
    @memset(bits, 0);
    for (snap.endpoints, 0..) |*e, j| {
        if (listed(e.running_adapters, adapter) or listed(e.waiting_adapters, adapter))
            bits[j / 64] |= @as(u64, 1) << @intCast(j % 64);
    }
    const key = try gpa.dupe(u8, adapter);
    adapter_bits.putAssumeCapacity(key, bits);
    return bits;
}

fn clearLast() void {
    last_bytes.clearRetainingCapacity();
    last_model.clearRetainingCapacity();
    last_end.clearRetainingCapacity();
    last_feat.clearRetainingCapacity();
    last_id.clearRetainingCapacity();
}

pub fn init(p: *const Params) sdk.Error!void {
    cfg = p.*;
    clearState();
}

fn uncached(ctx: *const sdk.ScoreCtx, i: usize) i64 {
    return @min(ctx.uncachedTokens(i) orelse @max(ctx.request.prompt_tokens, 0), 1 << 30);
}

/// Per model index: uncached tokens of the pending picks on it whose first token is not
/// due yet by their own prediction (at_ms + predicted_ms > now) — the prefill work ahead.
const Load = struct { ahead: []i64, picks: []i64 };

fn pendingLoad(now_ms: i64) sdk.Error!Load {
    const now: f64 = @floatFromInt(now_ms);
    if (now < ahead_now) {
        // An earlier `now` than the list is current for (a replayed or older snapshot):
        // picks dropped as due may not be due at it.
        ahead_list.clearRetainingCapacity();
        try ahead_list.ensureTotalCapacity(gpa, pending.count());
        for (pending.values()) |v| ahead_list.appendAssumeCapacity(aheadOf(v));
    }
    var i: usize = 0;
    while (i < ahead_list.items.len) {
        if (ahead_list.items[i].due > now) i += 1 else _ = ahead_list.swapRemove(i);
    }
    ahead_now = now;
    const ahead = try sdk.scratch().alloc(i64, models.count());
    @memset(ahead, 0);
    for (ahead_list.items) |a| ahead[a.model] +|= a.tokens;
    return .{ .ahead = ahead, .picks = pick_count.items };
}

fn aheadOf(v: Pending) Ahead {
    return .{ .due = @as(f64, @floatFromInt(v.at_ms)) + v.f.predicted_ms, .seq = v.seq,
              .model = v.model, .tokens = v.f.tokens };
}

/// Take a pending pick out of `pick_count` and `ahead_list`.
fn uncount(v: Pending) void {
    pick_count.items[v.model] -= 1;
    for (ahead_list.items, 0..) |a, i| {
        if (a.seq == v.seq) {
            _ = ahead_list.swapRemove(i);
            return;
        }
    }
}

/// The candidate whose model is `index` (null: none yet) is still being probed (fewer
/// than `min_samples` samples of its own) and already has `probe_inflight` picks pending.
fn probeFull(index: ?usize, load: Load) bool {
    if (cfg.probe_inflight == 0) return false;
    const k = index orelse return false;
    return models.values()[k].ttft.n < cfg.min_samples and load.picks[k] >= cfg.probe_inflight;
}

/// `index`: the candidate's model in `models` (null: none yet); `bits`: the request's
/// adapter on the resident snapshot (`adapterBits`), null to check the lists.
fn features(ctx: *const sdk.ScoreCtx, i: usize, index: ?usize, ahead_by_model: []const i64, bits: ?[]const u64) Features {
    const work: f64 = @floatFromInt(ctx.work(i));
    const tokens = uncached(ctx, i);
    const kilo: f64 = @as(f64, @floatFromInt(tokens)) / 1000.0;
    const ahead: i64 = if (index) |k| ahead_by_model[k] else 0;
    const adapter = ctx.request.adapter;
    const miss: f64 = if (adapter.len > 0 and !listedAt(ctx, i, adapter, bits)) cfg.adapter_ktokens else 0.0;
    return .{
        .ttft = .{cfg.overhead_ktokens + kilo + @as(f64, @floatFromInt(ahead)) / 1000.0 + cfg.work_ktokens * work + miss},
        .tpot = .{ 1, work },
        .tokens = tokens,
    };
}

/// The i-th candidate lists `adapter`, running or waiting (by `bits` when given).
inline fn listedAt(ctx: *const sdk.ScoreCtx, i: usize, adapter: []const u8, bits: ?[]const u64) bool {
    if (bits) |b| {
        const at = ctx.candidates[i];
        return (b[at / 64] >> @intCast(at % 64)) & 1 != 0;
    }
    const e = ctx.endpoint(i);
    return listed(e.running_adapters, adapter) or listed(e.waiting_adapters, adapter);
}

/// `want` is in `names` (as `Endpoint.isRunning`), its last and first bytes compared
/// before the rest: adapter names differ there more often than not, and a call to
/// `mem.eql` per listed adapter and candidate was a fifth of a score.
inline fn listed(names: []const []const u8, want: []const u8) bool {
    const last = want.len -% 1;
    for (names) |n| {
        if (n.len != want.len) continue;
        if (want.len > 0 and (n[last] != want[last] or n[0] != want[0])) continue;
        if (std.mem.eql(u8, n, want)) return true;
    }
    return false;
}

/// The model that predicts for the candidate whose model is `index` (null: none yet): its
/// own once it has `min_samples`, else pooled.
fn modelFor(index: ?usize) *Model {
    if (index) |k| {
        const m = &models.values()[k];
        if (m.ttft.n >= cfg.min_samples) return m;
    }
    return &pooled;
}

/// The TTFT `m` predicts at `now`: its coefficient blended into the pooled one as its
/// last sample ages (`stale_ms`).
fn predictTtft(m: *Model, x: *const [Ttft.dim]f64, now: i64) f64 {
    const own = m.ttft.predict(x);
    if (cfg.stale_ms == 0 or m == &pooled or m.last_ms == 0 or now <= m.last_ms) return own;
    const w = staleWeight(m, now);
    return w * own + (1.0 - w) * pooled.ttft.predict(x);
}

/// e^(−(now − last_ms) / stale_ms), computed once per model, `now` and `last_ms` (a new
/// sample moves `last_ms`, a new millisecond `now`: either recomputes it).
fn staleWeight(m: *Model, now: i64) f64 {
    if (m.w_now != now or m.w_last != m.last_ms) {
        const age: f64 = @floatFromInt(now - m.last_ms);
        m.w = @exp(-age / cfg.stale_ms);
        m.w_now = now;
        m.w_last = m.last_ms;
    }
    return m.w;
}

/// The index in `models` of the i-th candidate's address (null: none yet), through its
/// snapshot slot's hint when that still holds.
fn candidateModel(ctx: *const sdk.ScoreCtx, i: usize) sdk.Error!?usize {
    const address = ctx.endpoint(i).address;
    const at = ctx.candidates[i];
    if (at >= slots.items.len) try slots.appendNTimes(gpa, .{}, at + 1 - slots.items.len);
    const slot = &slots.items[at];
    const count = models.count();
    if (slot.model != 0) {
        if (slot.model - 1 < count and std.mem.eql(u8, models.keys()[slot.model - 1], address)) return slot.model - 1;
    } else if (slot.absent_at == count and std.mem.eql(u8, slot.absent.items, address)) {
        return null;
    }
    if (models.getIndex(address)) |k| {
        slot.model = @intCast(k + 1);
        return k;
    }
    slot.model = 0;
    slot.absent_at = std.math.maxInt(u32); // until `absent` holds the address
    slot.absent.clearRetainingCapacity();
    try slot.absent.appendSlice(gpa, address);
    slot.absent_at = @intCast(count);
    return null;
}

/// Within the SLO: 0.5 plus half the candidate's speed relative to the fastest (the
/// headroom alone ranked a 100 ms and a 300 ms candidate nearly alike under a 1 s SLO);
/// beyond it: below 0.5, the further the lower.
fn headroom(predicted: f64, best: f64, slo: f64) f64 {
    if (predicted <= slo) return 0.5 + 0.5 * best / predicted;
    return 0.5 * slo / predicted;
}

pub fn score(ctx: *const sdk.ScoreCtx, out: []f64) sdk.Error!void {
    clearLast();
    try last_id.appendSlice(gpa, ctx.request.request_id);
    try last_feat.ensureTotalCapacity(gpa, out.len);
    try last_end.ensureTotalCapacity(gpa, out.len);
    try last_model.ensureTotalCapacity(gpa, out.len);
    const t = try sdk.scratch().alloc(f64, out.len);
    const p = try sdk.scratch().alloc(f64, out.len);
    var t_min: f64 = inf;
    var p_min: f64 = inf;
    const now = @max(latest_ms, ctx.snapshot.timestamp_ms);
    const load = try pendingLoad(now);
    const full = try sdk.scratch().alloc(bool, out.len);
    // Each candidate's model, looked up once, by the hint of its snapshot slot when it
    // holds (a string hash per lookup was most of this policy's own time at 64 endpoints).
    const index = try sdk.scratch().alloc(?usize, out.len);
    var all_full = true;
    for (0..out.len) |i| {
        index[i] = try candidateModel(ctx, i);
        full[i] = probeFull(index[i], load);
        all_full = all_full and full[i];
    }
    if (all_full) @memset(full, false);
    const adapter = ctx.request.adapter;
    const bits = if (ctx.resident and adapter.len > 0) try adapterBits(ctx.snapshot, adapter) else null;
    for (0..out.len) |i| {
        var f = features(ctx, i, index[i], load.ahead, bits);
        const m = modelFor(index[i]);
        const ti = predictTtft(m, &f.ttft, now);
        const pi = m.tpot.predict(&f.tpot);
        t[i] = if (ti >= 1.0) ti else 1.0; // NaN too
        p[i] = if (pi >= 0.1) pi else 0.1;
        if (!full[i]) {
            t_min = fmin(t_min, t[i]);
            p_min = fmin(p_min, p[i]);
        }
        f.predicted_ms = t[i];
        last_feat.appendAssumeCapacity(f);
        if (index[i]) |k| {
            last_model.appendAssumeCapacity(@intCast(k));
        } else {
            last_model.appendAssumeCapacity(no_model);
            try last_bytes.appendSlice(gpa, ctx.endpoint(i).address);
        }
        last_end.appendAssumeCapacity(@intCast(last_bytes.items.len));
    }
    var slo_t: f64 = @floatFromInt(@max(ctx.request.slo_ttft_ms, 0));
    var slo_p: f64 = @floatFromInt(@max(ctx.request.slo_tpot_ms, 0));
    // An SLO no candidate is predicted to meet tells them nothing apart: rank by the
    // prediction alone then (the tiers would halve this policy's spread against the others').
    if (slo_t > 0 and t_min > slo_t) slo_t = 0;
    if (slo_p > 0 and p_min > slo_p) slo_p = 0;
    for (out, 0..) |*o, i| {
        if (full[i]) {
            o.* = 0;
            continue;
        }
        if (slo_t == 0 and slo_p == 0) {
            o.* = if (ctx.request.slo_tpot_ms > 0 and ctx.request.slo_ttft_ms == 0) p_min / p[i] else t_min / t[i];
            continue;
        }
        var s: f64 = 1.0;
        if (slo_t > 0) s = fmin(s, headroom(t[i], t_min, slo_t));
        if (slo_p > 0) s = fmin(s, headroom(p[i], p_min, slo_p));
        o.* = s;
    }
    stick(ctx, out, t, t_min, full, index);
}

/// Sticky until saturated: keep a session on its endpoint while the predicted TTFT there
/// is within `session_penalty_ms` of the best candidate's.
fn stick(ctx: *const sdk.ScoreCtx, out: []f64, t: []const f64, t_min: f64, full: []const bool, index: []const ?usize) void {
    const sid = ctx.request.session_id;
    if (sid.len == 0) return;
    const home = sessions.get(sid) orelse return;
    // The candidates whose address is `home` are those of its model, when it has one.
    const home_model = models.getIndex(home);
    for (0..out.len) |i| {
        if (full[i]) continue;
        if (home_model) |k| {
            if (index[i] != k) continue;
        } else if (!std.mem.eql(u8, ctx.endpoint(i).address, home)) continue;
        if (t[i] - t_min > cfg.session_penalty_ms) return; // saturated: let go
        for (out, 0..) |*o, j| o.* = if (j == i) 1.0 else o.* * 0.5;
        return;
    }
}

fn rememberSession(sid: []const u8, endpoint: []const u8) sdk.Error!void {
    if (cfg.max_sessions == 0) return;
    if (sessions.getPtr(sid)) |v| {
        if (std.mem.eql(u8, v.*, endpoint)) return;
        const copy = try gpa.dupe(u8, endpoint);
        gpa.free(v.*);
        v.* = copy;
        return;
    }
    while (sessions.count() >= cfg.max_sessions) {
        const k = sessions.keys()[0];
        const v = sessions.values()[0];
        sessions.orderedRemoveAt(0);
        gpa.free(k);
        gpa.free(v);
    }
    const key = try gpa.dupe(u8, sid);
    errdefer gpa.free(key);
    const value = try gpa.dupe(u8, endpoint);
    errdefer gpa.free(value);
    try sessions.put(gpa, key, value);
}

pub fn preRequest(ev: *const sdk.PreRequest) sdk.Error!void {
    latest_ms = @max(latest_ms, ev.timestamp_ms);
    if (ev.request.session_id.len > 0) try rememberSession(ev.request.session_id, ev.endpoint);
    const id = ev.request.request_id;
    if (id.len == 0 or !std.mem.eql(u8, id, last_id.items)) return;
    // The candidates whose address is the endpoint's are those of its model when it has
    // one (one hash instead of a string comparison per candidate), else among those
    // without a model.
    const want: u32 = if (models.getIndex(ev.endpoint)) |k| @intCast(k) else no_model;
    var start: u32 = 0;
    for (last_end.items, last_feat.items, last_model.items) |end, f, k| {
        const a = last_bytes.items[start..end];
        start = end;
        if (k != want) continue;
        if (k == no_model and !std.mem.eql(u8, a, ev.endpoint)) continue;
        try remember(id, ev.endpoint, f, ev.timestamp_ms, if (k != no_model) k else null);
        return;
    }
}

/// `known`: `address`'s index in `models`, when the caller has it.
fn remember(id: []const u8, address: []const u8, f: Features, at_ms: i64, known: ?u32) sdk.Error!void {
    // Drop picks whose completion never came, oldest first, then make room.
    while (pending.count() > 0) {
        const oldest = pending.values()[0];
        if (oldest.at_ms >= latest_ms -| cfg.pending_ttl_ms and pending.count() < cfg.max_pending) break;
        dropPending(0);
    }
    const model: u32 = known orelse @intCast(try modelIndex(address));
    try ahead_list.ensureUnusedCapacity(gpa, 1);
    const got = try pending.getOrPut(gpa, id);
    if (got.found_existing) {
        uncount(got.value_ptr.*);
    } else {
        got.key_ptr.* = gpa.dupe(u8, id) catch |err| {
            _ = pending.orderedRemove(id);
            return err;
        };
    }
    next_seq +%= 1;
    got.value_ptr.* = .{ .model = model, .f = f, .at_ms = at_ms, .seq = next_seq };
    pick_count.items[model] += 1;
    ahead_list.appendAssumeCapacity(aheadOf(got.value_ptr.*));
}

fn dropPending(index: usize) void {
    const k = pending.keys()[index];
    const v = pending.values()[index];
    uncount(v);
    pending.orderedRemoveAt(index);
    gpa.free(k);
}

fn modelOf(address: []const u8) sdk.Error!*Model {
    const k = try modelIndex(address); // first: it may grow (move) the values
    return &models.values()[k];
}

/// The index in `models` of `address`'s model, made from the prior if it has none yet.
fn modelIndex(address: []const u8) sdk.Error!usize {
    try pick_count.ensureUnusedCapacity(gpa, 1);
    const got = try models.getOrPut(gpa, address);
    if (!got.found_existing) {
        got.key_ptr.* = gpa.dupe(u8, address) catch |err| {
            _ = models.orderedRemove(address);
            return err;
        };
        pick_count.appendAssumeCapacity(0); // parallel to `models`
        // A new endpoint starts from the prior, not from the pooled model: in a mixed fleet
        // the pooled coefficient is an average no endpoint has.
        got.value_ptr.* = .{ .ttft = Ttft.init(priorTtft()), .tpot = Tpot.init(priorTpot()) };
    }
    return got.index;
}

pub fn postResponse(ev: *const sdk.PostResponse) sdk.Error!void {
    latest_ms = @max(latest_ms, ev.timestamp_ms);
    const index = pending.getIndex(ev.request_id) orelse return; // unknown or repeated
    const rec = pending.values()[index];
    defer dropPending(index);
    if (ev.status != 0 or !(ev.ttft_ms >= 0) or !std.math.isFinite(ev.ttft_ms)) return;
    const m = &models.values()[rec.model];
    m.ttft.update(&rec.f.ttft, bounded(&m.ttft, &rec.f.ttft, ev.ttft_ms), cfg.forgetting);
    m.last_ms = @max(m.last_ms, ev.timestamp_ms);
    pooled.ttft.update(&rec.f.ttft, bounded(&pooled.ttft, &rec.f.ttft, ev.ttft_ms), cfg.forgetting);
    if (ev.completion_tokens >= 2 and ev.timestamp_ms > rec.at_ms) {
        const e2e: f64 = @floatFromInt(ev.timestamp_ms - rec.at_ms);
        const tpot = (e2e - ev.ttft_ms) / @as(f64, @floatFromInt(ev.completion_tokens - 1));
        if (tpot >= 0) {
            m.tpot.update(&rec.f.tpot, tpot, cfg.forgetting);
            pooled.tpot.update(&rec.f.tpot, tpot, cfg.forgetting);
        }
    }
}

/// A TTFT sample within `outlier_ratio` of what model `m` fits for `x` (once `m` has
/// `min_samples` samples and fits a positive value).
fn bounded(m: *const Ttft, x: *const [Ttft.dim]f64, y: f64) f64 {
    if (cfg.outlier_ratio == 0 or m.n < @max(cfg.min_samples, 1)) return y;
    const fit = m.fitted(x);
    if (!(fit > 0)) return y;
    return std.math.clamp(y, fit / cfg.outlier_ratio, fit * cfg.outlier_ratio);
}

pub fn exportState(w: *sdk.Writer) sdk.Error!void {
    try w.arrayHeader(5);
    try w.int(state_format);
    try pooled.ttft.write(w);
    try pooled.tpot.write(w);
    try w.arrayHeader(@intCast(models.count()));
    for (models.keys(), models.values()) |k, m| {
        try w.arrayHeader(3);
        try w.str(k);
        try m.ttft.write(w);
        try m.tpot.write(w);
    }
    try w.arrayHeader(@intCast(sessions.count()));
    for (sessions.keys(), sessions.values()) |k, v| {
        try w.arrayHeader(2);
        try w.str(k);
        try w.str(v);
    }
}

pub fn importState(r: *sdk.Reader) sdk.Error!void {
    clearState();
    const elements = try r.arrayLen("latency state");
    if (elements != 4 and elements != 5) return sdk.fail("latency state has {d} elements, not 4 or 5", .{elements});
    const fmt = try r.int("latency state format");
    if (fmt != state_format) return sdk.fail("latency state format {d} is not {d}", .{ fmt, state_format });
    pooled.ttft = try Ttft.read(r, "latency state pooled TTFT model");
    pooled.tpot = try Tpot.read(r, "latency state pooled TPOT model");
    const n = try r.arrayLen("latency state endpoints");
    for (0..n) |_| {
        try fixedArray(r, "latency state endpoint", 3);
        const m = try modelOf(try r.str("latency state endpoint address"));
        m.ttft = try Ttft.read(r, "latency state endpoint TTFT model");
        m.tpot = try Tpot.read(r, "latency state endpoint TPOT model");
    }
    if (elements < 5) return; // a state from before sessions
    const ns = try r.arrayLen("latency state sessions");
    for (0..ns) |_| {
        try fixedArray(r, "latency state session", 2);
        const sid = try r.str("latency state session id");
        try rememberSession(sid, try r.str("latency state session endpoint"));
    }
}

comptime {
    sdk.exportPolicy(@This());
}
