//! precise-prefix — prefer endpoints whose own KV-cache events say they hold the request's
//! leading blocks (issue 16; llm-d's precise prefix scorer).
//!
//! Score on candidate i = prefix_matched[i] / prefix_blocks[i], the host's counts from the
//! engine's KV events (ScoreInput, ABI.md); 0 when the request has no full block. Where a
//! candidate has no count (no event stream, an uncertain index, or the host sent none) it
//! falls back to prefix-cache's approximate estimate (`sdk.prefix.Estimator`, fed by
//! `pre_request` as in prefix-cache, with the same params and hot-swap state), so the
//! policy works with no KV events at all and then scores exactly as prefix-cache does.
//! Events lag the pick: the engine publishes a request's blocks when it schedules it,
//! after the frontend and the queue. So a candidate the policy picked for the same leading
//! blocks within `recent_ttl_ms` scores that share too (`sdk.prefix.Recent`, at most
//! `recent_blocks` blocks per endpoint): with events, score = max(M / B, recent picks'
//! share). Without that, a burst of one tenant's requests would be spread over every
//! replica before the first one's blocks are announced (measured: 2.1 replicas per tenant
//! instead of 1.3, p90 TTFT 3.5× worse; docs/quality.md).
//! A cold request — no candidate with counts holds any of its blocks, by events or recent
//! picks: a full prefill wherever it goes — scores `cold_spread` on candidates this policy
//! has not sent a cold request to within `cold_spread_ms` and 0 on those it has, so full
//! prefills go to different engines instead of queueing behind each other on the replica
//! that looks least loaded (the load signal counts requests, not prefill work). Measured
//! under cache pressure (docs/quality.md): without it, evicted tenants re-placed by load
//! collided with another prefill twice as often as approximate's (which sends them back
//! where it wrongly thinks they are) and precise's p90 TTFT was worse at 20 QPS.
//! Affinity is bounded by load as in prefix-cache: a candidate whose work exceeds the
//! least-loaded candidate's by more than `max_imbalance` scores 0.

const std = @import("std");
const sdk = @import("epick");

pub const name = "precise-prefix";
pub const version = "1.0.0";
pub const kind = "precise-prefix";
pub const panic = sdk.panic;

pub const Params = struct {
    // The fallback estimate's params (prefix-cache's, same defaults).
    block_size: i64 = 64,
    max_blocks: i64 = 256,
    lru_capacity: i64 = 31_250,
    capacity_from_gpu_blocks: bool = false,
    /// A candidate whose work (ctx.work) exceeds the least-loaded candidate's by more than
    /// this scores 0, so load decides. Negative = never.
    max_imbalance: i64 = 8,
    /// How long a pick counts as "about to be cached" there, before its events confirm
    /// it (ms of the policy's clock); 0 = events alone.
    recent_ttl_ms: i64 = 2000,
    /// Most recent pick hashes kept per endpoint (≤ 13 per pick of 256 blocks: ~150 picks).
    recent_blocks: i64 = 2048,
    /// A request no candidate holds a block of (cold: a full prefill) scores
    /// `cold_spread` on every candidate this policy has not sent a cold request to within
    /// `cold_spread_ms`, 0 on the others: full prefills go to different engines instead of
    /// queueing behind each other on the least-loaded one. 0 = off.
    cold_spread_ms: i64 = 500,
    cold_spread: f64 = 0.25,

    pub fn check(p: *const Params) sdk.Error!void {
        try estimateConfig(p).check();
        if (p.recent_ttl_ms < 0 or p.recent_ttl_ms > 3_600_000) return sdk.fail("param 'recent_ttl_ms': {d} is not in [0, 3600000]", .{p.recent_ttl_ms});
        if (p.cold_spread_ms < 0 or p.cold_spread_ms > 3_600_000) return sdk.fail("param 'cold_spread_ms': {d} is not in [0, 3600000]", .{p.cold_spread_ms});
        if (!(p.cold_spread >= 0) or !(p.cold_spread <= 1)) return sdk.fail("param 'cold_spread': {d} is not in [0, 1]", .{p.cold_spread});
        if (p.recent_blocks < 0 or p.recent_blocks > 1 << 20) return sdk.fail("param 'recent_blocks': {d} is not in [0, 1048576]", .{p.recent_blocks});
    }
};

fn estimateConfig(p: *const Params) sdk.prefix.Config {
    return .{ .block_size = p.block_size, .max_blocks = p.max_blocks, .lru_capacity = p.lru_capacity, .capacity_from_gpu_blocks = p.capacity_from_gpu_blocks };
}

var max_imbalance: i64 = 8;
var recent_ttl_ms: i64 = 2000;
var recent_blocks: u32 = 2048;
var cold_spread_ms: i64 = 500;
var cold_spread: f64 = 0.25;
/// The last scored request when it was cold (its id and prompt hashed), else null: its
/// pick (pre_request) then stamps the endpoint's `cold_ms`. Another request scored in
/// between (concurrent picks) drops the mark: the spread is only weaker then.
var cold_request: ?u64 = null;
var est: sdk.prefix.Estimator(name) = .{};
/// What the policy remembers of its own picks on one endpoint.
const Picks = struct {
    recent: sdk.prefix.Recent,
    /// When it last sent this endpoint a cold request.
    cold_ms: i64 = std.math.minInt(i64),
};
// Per endpoint address (endpoints that leave the snapshot are dropped).
var recent: std.StringHashMapUnmanaged(*Picks) = .empty;

pub fn init(p: *const Params) sdk.Error!void {
    max_imbalance = p.max_imbalance;
    recent_ttl_ms = p.recent_ttl_ms;
    recent_blocks = @intCast(p.recent_blocks);
    cold_spread_ms = p.cold_spread_ms;
    cold_spread = p.cold_spread;
    cold_request = null;
    est.reset(estimateConfig(p));
    var it = recent.iterator();
    while (it.next()) |kv| freeRecent(kv.key_ptr.*, kv.value_ptr.*);
    recent.clearAndFree(sdk.gpa);
}

fn freeRecent(address: []const u8, r: *Picks) void {
    r.recent.deinit();
    sdk.gpa.destroy(r);
    sdk.gpa.free(address);
}

pub fn onSnapshot(snap: *const sdk.Snapshot) sdk.Error!void {
    try est.onSnapshot(sdk.scratch(), snap);
    var gone: std.ArrayList([]const u8) = .empty;
    var it = recent.iterator();
    while (it.next()) |kv| {
        if (snap.find(kv.key_ptr.*) == null) try gone.append(sdk.scratch(), kv.key_ptr.*);
    }
    for (gone.items) |address| {
        const kv = recent.fetchRemove(address).?;
        freeRecent(kv.key, kv.value);
    }
}

pub fn score(ctx: *const sdk.ScoreCtx, out: []f64) sdk.Error!void {
    const min_work = if (max_imbalance >= 0) ctx.minWork() else 0;
    // The estimate's hashes only when some candidate needs them.
    var hashes: ?[]const u64 = null;
    // Whether some candidate holds a block (events, recent picks or, without counts, the
    // estimate), and whether some candidate has counts of a request with a full block.
    var warm = false;
    var counted = false;
    cold_request = null;
    for (out, ctx.candidates, 0..) |*o, c, i| {
        if (max_imbalance >= 0 and ctx.work(i) - min_work > max_imbalance) {
            o.* = 0;
            continue;
        }
        if (hashes == null) {
            hashes = try est.blockHashes(sdk.scratch(), &ctx.request);
            try est.sync(sdk.scratch(), ctx.snapshot);
        }
        const h = hashes.?;
        if (ctx.prefixMatched(i)) |m| {
            const blocks = ctx.prefixBlocks(i).?;
            o.* = if (blocks == 0) 0 else @as(f64, @floatFromInt(m)) / @as(f64, @floatFromInt(blocks));
            if (h.len > 0 and recent_ttl_ms > 0) {
                if (recent.get(ctx.endpoint(i).address)) |r| {
                    // Picks made before its engine last emptied its cache are void.
                    const since = @max(ctx.snapshot.timestamp_ms -| recent_ttl_ms, clearedAt(ctx, i));
                    const share = @as(f64, @floatFromInt(r.recent.matched(h, since))) / @as(f64, @floatFromInt(h.len));
                    o.* = @max(o.*, share);
                }
            }
            if (blocks > 0) counted = true;
            if (o.* > 0) warm = true;
            continue;
        }
        o.* = if (h.len == 0) 0 else @as(f64, @floatFromInt(est.matched(c, h))) / @as(f64, @floatFromInt(h.len));
        if (o.* > 0) warm = true;
    }
    if (cold_spread_ms == 0 or warm or !counted or hashes.?.len == 0) return;
    cold_request = requestKey(&ctx.request);
    const since = ctx.snapshot.timestamp_ms -| cold_spread_ms;
    for (out, 0..) |*o, i| {
        if (max_imbalance >= 0 and ctx.work(i) - min_work > max_imbalance) continue;
        if (ctx.prefixMatched(i) == null) continue;
        const busy = if (recent.get(ctx.endpoint(i).address)) |r| r.cold_ms >= @max(since, clearedAt(ctx, i)) else false;
        o.* = if (busy) 0 else cold_spread;
    }
}

/// When candidate i's engine last emptied its cache (host ms; minInt = never).
fn clearedAt(ctx: *const sdk.ScoreCtx, i: usize) i64 {
    return ctx.prefixClearedMs(i) orelse std.math.minInt(i64);
}

fn requestKey(q: *const sdk.Request) u64 {
    var h = std.hash.Wyhash.init(0);
    h.update(q.request_id);
    h.update(&.{0});
    h.update(q.prompt);
    return h.final();
}

pub fn preRequest(ev: *const sdk.PreRequest) sdk.Error!void {
    try est.record(sdk.scratch(), ev);
    const cold = if (cold_request) |k| k == requestKey(&ev.request) else false;
    cold_request = null;
    if (!cold and (recent_ttl_ms == 0 or recent_blocks == 0)) return;
    const hashes = try est.blockHashes(sdk.scratch(), &ev.request);
    if (hashes.len == 0) return;
    const gop = try recent.getOrPut(sdk.gpa, ev.endpoint);
    if (!gop.found_existing) {
        const r = sdk.gpa.create(Picks) catch |e| {
            recent.removeByPtr(gop.key_ptr);
            return e;
        };
        r.* = .{ .recent = sdk.prefix.Recent.init(recent_blocks) };
        gop.key_ptr.* = sdk.gpa.dupe(u8, ev.endpoint) catch |e| {
            sdk.gpa.destroy(r);
            recent.removeByPtr(gop.key_ptr);
            return e;
        };
        gop.value_ptr.* = r;
    }
    if (cold) gop.value_ptr.*.cold_ms = ev.timestamp_ms;
    if (recent_ttl_ms == 0 or recent_blocks == 0) return;
    try gop.value_ptr.*.recent.record(hashes, ev.timestamp_ms);
}

pub fn exportState(w: *sdk.Writer) sdk.Error!void {
    try est.exportState(sdk.scratch(), w);
}

pub fn importState(r: *sdk.Reader) sdk.Error!void {
    try est.importState(r);
}

comptime {
    sdk.exportPolicy(@This());
}
