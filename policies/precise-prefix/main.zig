//! precise-prefix — prefer endpoints whose own KV-cache events say they hold the request's
//! leading blocks (issue 16; llm-d's precise prefix scorer).
//!
//! Score on candidate i = prefix_matched[i] / prefix_blocks[i], the host's counts from the
//! engine's KV events (ScoreInput, ABI.md); 0 when the request has no full block. Where a
//! candidate has no count (no event stream, an uncertain index, or the host sent none) it
//! falls back to prefix-cache's approximate estimate (`sdk.prefix.Estimator`, fed by
//! `pre_request` as in prefix-cache, with the same params and hot-swap state), so the
//! policy works with no KV events at all and then scores exactly as prefix-cache does.
//! Affinity is bounded by load as in prefix-cache: a candidate whose work exceeds the
//! least-loaded candidate's by more than `max_imbalance` scores 0.

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

    pub fn check(p: *const Params) sdk.Error!void {
        try estimateConfig(p).check();
    }
};

fn estimateConfig(p: *const Params) sdk.prefix.Config {
    return .{ .block_size = p.block_size, .max_blocks = p.max_blocks, .lru_capacity = p.lru_capacity, .capacity_from_gpu_blocks = p.capacity_from_gpu_blocks };
}

var max_imbalance: i64 = 8;
var est: sdk.prefix.Estimator(name) = .{};

pub fn init(p: *const Params) sdk.Error!void {
    max_imbalance = p.max_imbalance;
    est.reset(estimateConfig(p));
}

pub fn onSnapshot(snap: *const sdk.Snapshot) sdk.Error!void {
    try est.onSnapshot(sdk.scratch(), snap);
}

pub fn score(ctx: *const sdk.ScoreCtx, out: []f64) sdk.Error!void {
    const min_work = if (max_imbalance >= 0) ctx.minWork() else 0;
    // The estimate's hashes only when some candidate needs them.
    var hashes: ?[]const u64 = null;
    for (out, ctx.candidates, 0..) |*o, c, i| {
        if (max_imbalance >= 0 and ctx.work(i) - min_work > max_imbalance) {
            o.* = 0;
            continue;
        }
        if (ctx.prefixMatched(i)) |m| {
            const blocks = ctx.prefixBlocks(i).?;
            o.* = if (blocks == 0) 0 else @as(f64, @floatFromInt(m)) / @as(f64, @floatFromInt(blocks));
            continue;
        }
        if (hashes == null) {
            hashes = try est.blockHashes(sdk.scratch(), &ctx.request);
            try est.sync(sdk.scratch(), ctx.snapshot);
        }
        const h = hashes.?;
        o.* = if (h.len == 0) 0 else @as(f64, @floatFromInt(est.matched(c, h))) / @as(f64, @floatFromInt(h.len));
    }
}

pub fn preRequest(ev: *const sdk.PreRequest) sdk.Error!void {
    try est.record(sdk.scratch(), ev);
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
