//! legacy-v1 — the pre-v2 scheduler's filter tree, for the regression benchmark
//! (docs/scoring.md, "legacy-v1"; seed 002).
//!
//! `filter` keeps the survivors of the tree; `score` gives every candidate 1.0, so the
//! host's seeded random tie-break makes the final pick uniformly among the survivors.
//!
//!   CRITICAL:      low-queue (waiting < queue_threshold_lora) → LoRA affinity
//!                  → least-queue → least-KV
//!   STANDARD, SHEDDABLE: capacity (waiting ≤ capacity_queue and kv ≤ capacity_kv),
//!                  then least-queue → LoRA affinity → least-KV (upstream's
//!                  queueLoRAAndKVCacheFilter); no endpoint with capacity → shed: keep
//!                  nothing.
//!
//! A node that leaves nothing is a failure and passes its input on. least-queue keeps
//! waiting ∈ [min, min + (max − min) / N] (integer division, N = endpoints in its input);
//! least-KV the same with floats. LoRA affinity: "affinity" = endpoints with the adapter
//! running or waiting, "available" = the others with |running| + |waiting| < max_lora;
//! when both are non-empty, affinity wins if a draw u ∈ [0, 1) is < affinity_probability;
//! otherwise whichever is non-empty. u is the first SplitMix64 output of Request.seed.

const std = @import("std");
const sdk = @import("epick");

pub const name = "legacy-v1";
pub const version = "1.0.0";
pub const kind = "legacy-v1";
pub const panic = sdk.panic;

pub const Params = struct {
    queue_threshold_lora: i64 = 128,
    affinity_probability: f64 = 0.999,
    capacity_queue: i64 = 5,
    capacity_kv: f64 = 0.8,

    pub fn check(p: *const Params) sdk.Error!void {
        if (!(p.affinity_probability >= 0 and p.affinity_probability <= 1))
            return sdk.fail("param 'affinity_probability': {d} is not in [0, 1]", .{p.affinity_probability});
        if (!(p.capacity_kv >= 0 and p.capacity_kv <= 1))
            return sdk.fail("param 'capacity_kv': {d} is not in [0, 1]", .{p.capacity_kv});
    }
};

var cfg: Params = .{};

pub fn init(p: *const Params) sdk.Error!void {
    cfg = p.*;
}

/// Candidate positions (into ctx.candidates) still in the running.
const Set = []u32;

fn lowQueue(ctx: *const sdk.ScoreCtx, in: Set, out: []u32) Set {
    var n: usize = 0;
    for (in) |i| {
        if (ctx.endpoint(i).waiting < cfg.queue_threshold_lora) {
            out[n] = i;
            n += 1;
        }
    }
    return out[0..n];
}

fn capacity(ctx: *const sdk.ScoreCtx, in: Set, out: []u32) Set {
    var n: usize = 0;
    for (in) |i| {
        const e = ctx.endpoint(i);
        if (e.waiting <= cfg.capacity_queue and e.kv_usage <= cfg.capacity_kv) {
            out[n] = i;
            n += 1;
        }
    }
    return out[0..n];
}

fn leastQueue(ctx: *const sdk.ScoreCtx, in: Set, out: []u32) Set {
    var lo: i64 = std.math.maxInt(i64);
    var hi: i64 = std.math.minInt(i64);
    for (in) |i| {
        lo = @min(lo, ctx.endpoint(i).waiting);
        hi = @max(hi, ctx.endpoint(i).waiting);
    }
    // i128: a garbage pool with waiting near the i64 limits must not overflow.
    const limit: i128 = @as(i128, lo) + @divTrunc(@as(i128, hi) - lo, @as(i128, @intCast(in.len)));
    var n: usize = 0;
    for (in) |i| {
        if (ctx.endpoint(i).waiting <= limit) {
            out[n] = i;
            n += 1;
        }
    }
    return out[0..n];
}

fn leastKv(ctx: *const sdk.ScoreCtx, in: Set, out: []u32) Set {
    var lo: f64 = std.math.inf(f64);
    var hi: f64 = -std.math.inf(f64);
    for (in) |i| {
        lo = @min(lo, ctx.endpoint(i).kv_usage);
        hi = @max(hi, ctx.endpoint(i).kv_usage);
    }
    const limit = lo + (hi - lo) / @as(f64, @floatFromInt(in.len));
    var n: usize = 0;
    for (in) |i| {
        if (ctx.endpoint(i).kv_usage <= limit) {
            out[n] = i;
            n += 1;
        }
    }
    return out[0..n];
}

fn loraAffinity(ctx: *const sdk.ScoreCtx, in: Set, out: []u32) sdk.Error!Set {
    const adapter = ctx.request.adapter;
    const available = try sdk.scratch().alloc(u32, in.len);
    var n_aff: usize = 0;
    var n_av: usize = 0;
    for (in) |i| {
        const e = ctx.endpoint(i);
        if (e.isRunning(adapter) or e.isWaiting(adapter)) {
            out[n_aff] = i;
            n_aff += 1;
        } else if (@as(i64, @intCast(e.running_adapters.len + e.waiting_adapters.len)) < e.max_lora) {
            available[n_av] = i;
            n_av += 1;
        }
    }
    if (n_aff > 0 and n_av > 0) {
        var rng = sdk.SplitMix64.init(ctx.request.seed);
        if (rng.float() < cfg.affinity_probability) return out[0..n_aff];
        @memcpy(out[0..n_av], available[0..n_av]);
        return out[0..n_av];
    }
    if (n_aff > 0) return out[0..n_aff];
    @memcpy(out[0..n_av], available[0..n_av]);
    return out[0..n_av];
}

pub fn filter(ctx: *const sdk.ScoreCtx, keep: []u8) sdk.Error!void {
    const n = ctx.candidates.len;
    if (n == 0) return;
    const a = try sdk.scratch().alloc(u32, n);
    const b = try sdk.scratch().alloc(u32, n);
    for (a, 0..) |*x, i| x.* = @intCast(i);
    // Two buffers: each node writes into the one the current set is not in.
    var cur: Set = a;
    var spare: []u32 = b;
    if (ctx.request.criticality == sdk.Criticality.critical) {
        cur = try run(ctx, cur, &spare, .low_queue);
        cur = try run(ctx, cur, &spare, .lora);
        cur = try run(ctx, cur, &spare, .least_queue);
        cur = try run(ctx, cur, &spare, .least_kv);
    } else {
        const with_capacity = capacity(ctx, cur, spare);
        if (with_capacity.len == 0) {
            @memset(keep, 0); // shed
            return;
        }
        spare = cur;
        cur = with_capacity;
        cur = try run(ctx, cur, &spare, .least_queue);
        cur = try run(ctx, cur, &spare, .lora);
        cur = try run(ctx, cur, &spare, .least_kv);
    }
    @memset(keep, 0);
    for (cur) |i| keep[i] = 1;
}

const Node = enum { low_queue, lora, least_queue, least_kv };

/// Apply `which` to `cur`, writing into `spare.*`; on success the buffers trade places.
fn run(ctx: *const sdk.ScoreCtx, cur: Set, spare: *[]u32, which: Node) sdk.Error!Set {
    const out = spare.*;
    const result = switch (which) {
        .low_queue => lowQueue(ctx, cur, out),
        .lora => try loraAffinity(ctx, cur, out),
        .least_queue => leastQueue(ctx, cur, out),
        .least_kv => leastKv(ctx, cur, out),
    };
    if (result.len == 0) return cur;
    // The old set's buffer becomes the spare (full length: both buffers are n long).
    spare.* = cur.ptr[0..out.len];
    return result;
}

pub fn score(ctx: *const sdk.ScoreCtx, out: []f64) sdk.Error!void {
    _ = ctx;
    @memset(out, 1.0);
}

comptime {
    sdk.exportPolicy(@This());
}
