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
//!
//! Recent picks (base-model requests only): a candidate picked `age` ms ago (the policy's
//! own pre_request events; age from the latest of the snapshot's and the events'
//! timestamps) counts `recent_requests · e^(−age / recent_ms)` more requests in `work`.
//! Its last request is likely still in the engine's front end or prefill, which no page
//! shows yet; spacing each replica's new requests is what keeps TTFT down on unique
//! prompts (docs/quality.md, "Zero-hit"). Adapter requests score as without it.

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
    recent_requests: f64 = 8.0,
    recent_ms: f64 = 45.0,

    pub fn check(p: *const Params) sdk.Error!void {
        // `!(x >= 0)` also refuses NaN.
        if (!(p.queue_weight >= 0) or !(p.queue_weight < inf)) return sdk.fail("param 'queue_weight': {d} must be a finite number >= 0", .{p.queue_weight});
        if (!(p.kv_weight >= 0) or !(p.kv_weight < inf)) return sdk.fail("param 'kv_weight': {d} must be a finite number >= 0", .{p.kv_weight});
        if (!(p.work_weight >= 0) or !(p.work_weight < inf)) return sdk.fail("param 'work_weight': {d} must be a finite number >= 0", .{p.work_weight});
        if (!(p.work_scale > 0) or !(p.work_scale < inf)) return sdk.fail("param 'work_scale': {d} must be a finite number > 0", .{p.work_scale});
        if (!(p.recent_requests >= 0) or !(p.recent_requests < inf)) return sdk.fail("param 'recent_requests': {d} must be a finite number >= 0", .{p.recent_requests});
        if (!(p.recent_ms > 0) or !(p.recent_ms < inf)) return sdk.fail("param 'recent_ms': {d} must be a finite number > 0", .{p.recent_ms});
        if (p.queue_weight + p.kv_weight + p.work_weight == 0) return sdk.fail("params 'queue_weight', 'kv_weight' and 'work_weight' are all 0; at least one must be > 0", .{});
    }
};

const inf = std.math.inf(f64);
const std = @import("std");

var wq: f64 = 1.0;
var wkv: f64 = 1.0;
var ww: f64 = 2.0;
var scale: f64 = 8.0;
var recent_n: f64 = 8.0;
var recent_ms: f64 = 45.0;

const gpa = sdk.gpa;
/// Address (owned) -> timestamp_ms of its latest pick.
var last_pick: std.StringHashMapUnmanaged(i64) = .empty;
/// The latest pre_request timestamp seen (the policy's clock between snapshots).
var latest_ms: i64 = std.math.minInt(i64);
/// Past this many addresses, a pick drops those not picked for 100 · recent_ms.
const max_addresses = 4096;

pub fn init(p: *const Params) sdk.Error!void {
    wq = p.queue_weight;
    wkv = p.kv_weight;
    ww = p.work_weight;
    scale = p.work_scale;
    recent_n = p.recent_requests;
    recent_ms = p.recent_ms;
    var it = last_pick.keyIterator();
    while (it.next()) |k| gpa.free(k.*);
    last_pick.clearAndFree(gpa);
    latest_ms = std.math.minInt(i64);
}

pub fn preRequest(ev: *const sdk.PreRequest) sdk.Error!void {
    latest_ms = @max(latest_ms, ev.timestamp_ms);
    if (recent_n == 0 or ev.endpoint.len == 0) return;
    if (last_pick.getPtr(ev.endpoint)) |t| {
        t.* = @max(t.*, ev.timestamp_ms);
        return;
    }
    if (last_pick.count() >= max_addresses) prune(ev.timestamp_ms);
    const key = gpa.dupe(u8, ev.endpoint) catch return sdk.fail("out of memory", .{});
    last_pick.put(gpa, key, ev.timestamp_ms) catch {
        gpa.free(key);
        return sdk.fail("out of memory", .{});
    };
}

fn prune(now: i64) void {
    const horizon: f64 = 100.0 * recent_ms;
    var i: usize = 0;
    var dead: [64][]const u8 = undefined;
    var it = last_pick.iterator();
    while (it.next()) |kv| {
        if (@as(f64, @floatFromInt(now -| kv.value_ptr.*)) > horizon and i < dead.len) {
            dead[i] = kv.key_ptr.*;
            i += 1;
        }
    }
    for (dead[0..i]) |k| {
        _ = last_pick.remove(k);
        gpa.free(k);
    }
}

/// Requests a recent pick of `address` adds to its work at `now`.
fn recentWork(address: []const u8, now: i64) f64 {
    const t = last_pick.get(address) orelse return 0.0;
    const age: f64 = @floatFromInt(@max(now -| t, 0));
    return recent_n * @exp(-age / recent_ms);
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
    const recent = recent_n > 0 and ctx.request.adapter.len == 0 and last_pick.count() > 0;
    const now = @max(latest_ms, ctx.snapshot.timestamp_ms);
    for (out, 0..) |*o, i| {
        const e = ctx.endpoint(i);
        const queue: f64 = if (max_q == min_q) 1.0 else @as(f64, @floatFromInt(@as(i128, max_q) - e.waiting)) / span;
        // NaN kv_usage (never sent by the host) would compare false both ways: treat as full.
        const kv_used: f64 = if (e.kv_usage >= 0) @min(e.kv_usage, 1.0) else if (e.kv_usage < 0) 0.0 else 1.0;
        const kv = 1.0 - kv_used;
        var w: f64 = @floatFromInt(ctx.work(i));
        if (recent) w += recentWork(e.address, now);
        const work = scale / (scale + w);
        o.* = (wq * queue + wkv * kv + ww * work) / (wq + wkv + ww);
    }
}

comptime {
    sdk.exportPolicy(@This());
}
