//! prefix-cache — prefer endpoints that likely hold the request's prompt prefix in their
//! KV cache (docs/scoring.md, "prefix-cache").
//!
//! The estimate (block hashing, per-endpoint LRUs, hot-swap state) is the SDK's
//! `sdk.prefix.Estimator` (policies/sdk/prefix.zig, which documents the hash chain), shared
//! with precise-prefix. Score on an endpoint = (leading hashes h0..h(k−1) all present
//! there) / (blocks); 0 everywhere when the prompt has no whole block. Scoring never
//! touches the LRUs. `pre_request` inserts h0..h(n−1), in that order, into the picked
//! endpoint's LRU.

const sdk = @import("epick");

pub const name = "prefix-cache";
pub const version = "1.0.0";
pub const kind = "prefix-cache";
pub const panic = sdk.panic;

pub const Params = struct {
    block_size: i64 = 64,
    max_blocks: i64 = 256,
    lru_capacity: i64 = 31_250,
    capacity_from_gpu_blocks: bool = false,
    /// Affinity bounded by load: a candidate whose work (ctx.work) exceeds the least-loaded
    /// candidate's by more than this scores 0, so load decides (SGLang's cache-aware router
    /// does the same with its balance threshold). Negative = never.
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
    const hashes = try est.blockHashes(sdk.scratch(), &ctx.request);
    if (hashes.len == 0) {
        @memset(out, 0);
        return;
    }
    try est.sync(sdk.scratch(), ctx.snapshot);
    const n: f64 = @floatFromInt(hashes.len);
    const min_work = if (max_imbalance >= 0) ctx.minWork() else 0;
    for (out, ctx.candidates, 0..) |*o, c, i| {
        if (max_imbalance >= 0 and ctx.work(i) - min_work > max_imbalance) {
            o.* = 0;
            continue;
        }
        o.* = @as(f64, @floatFromInt(est.matched(c, hashes))) / n;
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
