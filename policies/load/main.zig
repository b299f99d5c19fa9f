//! load — queue depth and KV-cache use (docs/scoring.md, "load").
//!
//!   queue = (max_q − q) / (max_q − min_q) over the candidates; 1.0 for all when equal
//!   kv    = 1 − clamp(kv_usage, 0, 1)
//!   work  = work_scale / (work_scale + w), w = ctx.work(i) = max(running + waiting +
//!           picked_since_scrape, in_flight): absolute, so an idle replica (1.0) is told
//!           from a busy one at any load, and a replica just given work stops looking idle
//!           before its next scrape
//!   score = (queue_weight · queue + kv_weight · kv + work_weight · work)
//!           / (queue_weight + kv_weight + work_weight)

const sdk = @import("epick");

pub const name = "load";
pub const version = "1.0.0";
pub const kind = "load";
pub const panic = sdk.panic;

pub const Params = struct {
    queue_weight: f64 = 1.0,
    kv_weight: f64 = 1.0,
    work_weight: f64 = 2.0,
    work_scale: f64 = 8.0,

    pub fn check(p: *const Params) sdk.Error!void {
        // `!(x >= 0)` also refuses NaN.
        if (!(p.queue_weight >= 0) or !(p.queue_weight < inf)) return sdk.fail("param 'queue_weight': {d} must be a finite number >= 0", .{p.queue_weight});
        if (!(p.kv_weight >= 0) or !(p.kv_weight < inf)) return sdk.fail("param 'kv_weight': {d} must be a finite number >= 0", .{p.kv_weight});
        if (!(p.work_weight >= 0) or !(p.work_weight < inf)) return sdk.fail("param 'work_weight': {d} must be a finite number >= 0", .{p.work_weight});
        if (!(p.work_scale > 0) or !(p.work_scale < inf)) return sdk.fail("param 'work_scale': {d} must be a finite number > 0", .{p.work_scale});
        if (p.queue_weight + p.kv_weight + p.work_weight == 0) return sdk.fail("params 'queue_weight', 'kv_weight' and 'work_weight' are all 0; at least one must be > 0", .{});
    }
};

const inf = std.math.inf(f64);
const std = @import("std");

var wq: f64 = 1.0;
var wkv: f64 = 1.0;
var ww: f64 = 2.0;
var scale: f64 = 8.0;

pub fn init(p: *const Params) sdk.Error!void {
    wq = p.queue_weight;
    wkv = p.kv_weight;
    ww = p.work_weight;
    scale = p.work_scale;
}

pub fn score(ctx: *const sdk.ScoreCtx, out: []f64) sdk.Error!void {
    if (out.len == 0) return;
    var min_q: i64 = std.math.maxInt(i64);
    var max_q: i64 = std.math.minInt(i64);
    for (0..out.len) |i| {
        const q = ctx.endpoint(i).waiting;
        min_q = @min(min_q, q);
        max_q = @max(max_q, q);
    }
    // In i128: a garbage pool with queues near the i64 limits must not overflow.
    const span: f64 = @floatFromInt(@as(i128, max_q) - min_q);
    for (out, 0..) |*o, i| {
        const e = ctx.endpoint(i);
        const queue: f64 = if (max_q == min_q) 1.0 else @as(f64, @floatFromInt(@as(i128, max_q) - e.waiting)) / span;
        // NaN kv_usage (never sent by the host) would compare false both ways: treat as full.
        const kv_used: f64 = if (e.kv_usage >= 0) @min(e.kv_usage, 1.0) else if (e.kv_usage < 0) 0.0 else 1.0;
        const kv = 1.0 - kv_used;
        const work = scale / (scale + @as(f64, @floatFromInt(ctx.work(i))));
        o.* = (wq * queue + wkv * kv + ww * work) / (wq + wkv + ww);
    }
}

comptime {
    sdk.exportPolicy(@This());
}
