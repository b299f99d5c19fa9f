//! prefix-cache — prefer endpoints that likely hold the request's prompt prefix in their
//! KV cache (DESIGN.md, "Prefix cache").
//!
//! The prompt's UTF-8 bytes are cut into `block_size`-byte blocks (a trailing partial
//! block is ignored; at most `max_blocks` blocks). With xxh64, seed 0:
//!   h0 = xxh64(model ‖ block0)                        without a cache salt
//!   h0 = xxh64(model ‖ 0x00 ‖ cache_salt ‖ 0x00 ‖ block0)   with one
//!   hi = xxh64(block_i ‖ little-endian u64 of h(i−1))
//! The NUL bytes keep ("ab", salt "c") and ("a", salt "bc") apart; model names cannot
//! contain NUL (the host refuses control characters in them).
//! Score on an endpoint = (leading hashes h0..h(k−1) all present there) / (blocks); 0
//! everywhere when the prompt has no whole block. Scoring never touches the LRUs.
//! `pre_request` inserts h0..h(n−1), in that order, into the picked endpoint's LRU (so
//! the last block is the most recently used). Endpoints that leave the snapshot are
//! forgotten. Capacity per endpoint: `lru_capacity`, or with `capacity_from_gpu_blocks`
//! min(num_gpu_blocks, lru_capacity) when the endpoint reports num_gpu_blocks > 0.

const std = @import("std");
const sdk = @import("epick");
const Lru = @import("lru.zig").Lru;
const max_capacity = @import("lru.zig").max_capacity;

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
        if (p.block_size < 1 or p.block_size > 1 << 20) return sdk.fail("param 'block_size': {d} is not in [1, 1048576]", .{p.block_size});
        if (p.max_blocks < 1 or p.max_blocks > 4096) return sdk.fail("param 'max_blocks': {d} is not in [1, 4096]", .{p.max_blocks});
        if (p.lru_capacity < 0 or p.lru_capacity > max_capacity) return sdk.fail("param 'lru_capacity': {d} is not in [0, {d}]", .{ p.lru_capacity, max_capacity });
    }
};

const gpa = sdk.gpa;

const EpState = struct {
    address: []u8,
    lru: Lru,
};

var cfg: Params = .{};
var endpoints: std.StringHashMapUnmanaged(*EpState) = .empty;
// Snapshot index -> that endpoint's state (every snapshot endpoint has one).
var by_index: std.ArrayList(*EpState) = .empty;
var by_index_version: ?i64 = null;

pub fn init(p: *const Params) sdk.Error!void {
    cfg = p.*;
    clearState();
}

fn clearState() void {
    var it = endpoints.iterator();
    while (it.next()) |kv| freeEp(kv.value_ptr.*);
    endpoints.clearAndFree(gpa);
    by_index.clearAndFree(gpa);
    by_index_version = null;
}

fn freeEp(st: *EpState) void {
    st.lru.deinit(gpa);
    gpa.free(st.address);
    gpa.destroy(st);
}

fn capacityOf(e: ?*const sdk.Endpoint) u32 {
    const base: u32 = @intCast(cfg.lru_capacity);
    if (cfg.capacity_from_gpu_blocks) {
        if (e) |ep| if (ep.num_gpu_blocks > 0) return @intCast(@min(ep.num_gpu_blocks, base));
    }
    return base;
}

fn epState(address: []const u8, cap: u32) sdk.Error!*EpState {
    const gop = try endpoints.getOrPut(gpa, address);
    if (gop.found_existing) return gop.value_ptr.*;
    const st = gpa.create(EpState) catch |e| {
        endpoints.removeByPtr(gop.key_ptr);
        return e;
    };
    st.* = .{
        .address = gpa.dupe(u8, address) catch |e| {
            gpa.destroy(st);
            endpoints.removeByPtr(gop.key_ptr);
            return e;
        },
        .lru = Lru.init(cap),
    };
    gop.key_ptr.* = st.address;
    gop.value_ptr.* = st;
    return st;
}

// -- hashing ----------------------------------------------------------------------------

/// The request's block hashes, h0..h(n−1), in scratch memory.
fn blockHashes(q: *const sdk.Request) sdk.Error![]u64 {
    const bs: usize = @intCast(cfg.block_size);
    const n = @min(q.prompt.len / bs, @as(usize, @intCast(cfg.max_blocks)));
    const out = try sdk.scratch().alloc(u64, n);
    var prev: u64 = 0;
    for (out, 0..) |*h, i| {
        const block = q.prompt[i * bs ..][0..bs];
        var x = std.hash.XxHash64.init(0);
        if (i == 0) {
            x.update(q.model);
            if (q.cache_salt.len > 0) {
                x.update(&[_]u8{0});
                x.update(q.cache_salt);
                x.update(&[_]u8{0});
            }
            x.update(block);
        } else {
            var le: [8]u8 = undefined;
            std.mem.writeInt(u64, &le, prev, .little);
            x.update(block);
            x.update(&le);
        }
        h.* = x.final();
        prev = h.*;
    }
    return out;
}

// -- hooks ------------------------------------------------------------------------------

pub fn onSnapshot(snap: *const sdk.Snapshot) sdk.Error!void {
    // Forget endpoints that left; give every present one a state with the capacity its
    // metrics imply. Its LRU starts small (512 hashes) and doubles as it fills: memory
    // follows use, and a busy pool allocates up front rather than on its first requests.
    var present: std.StringHashMapUnmanaged(void) = .empty;
    try present.ensureTotalCapacity(sdk.scratch(), @intCast(snap.endpoints.len));
    for (snap.endpoints) |*e| present.putAssumeCapacity(e.address, {});
    var gone: std.ArrayList(*EpState) = .empty;
    var it = endpoints.iterator();
    while (it.next()) |kv| {
        if (!present.contains(kv.key_ptr.*)) try gone.append(sdk.scratch(), kv.value_ptr.*);
    }
    for (gone.items) |st| {
        _ = endpoints.remove(st.address);
        freeEp(st);
    }
    try by_index.resize(gpa, snap.endpoints.len);
    for (snap.endpoints, by_index.items) |*e, *slot| {
        const cap = capacityOf(e);
        const st = try epState(e.address, cap);
        if (st.lru.cap != cap) try st.lru.setCap(gpa, cap);
        try st.lru.reserve(gpa);
        slot.* = st;
    }
    by_index_version = snap.version;
}

pub fn score(ctx: *const sdk.ScoreCtx, out: []f64) sdk.Error!void {
    const hashes = try blockHashes(&ctx.request);
    if (hashes.len == 0) {
        @memset(out, 0);
        return;
    }
    if (by_index_version != ctx.snapshot.version or by_index.items.len != ctx.snapshot.endpoints.len)
        try onSnapshot(ctx.snapshot);
    const n: f64 = @floatFromInt(hashes.len);
    const min_work = if (cfg.max_imbalance >= 0) ctx.minWork() else 0;
    for (out, ctx.candidates, 0..) |*o, c, i| {
        if (cfg.max_imbalance >= 0 and ctx.work(i) - min_work > cfg.max_imbalance) {
            o.* = 0;
            continue;
        }
        const lru = &by_index.items[c].lru;
        var k: usize = 0;
        while (k < hashes.len and lru.contains(hashes[k])) k += 1;
        o.* = @as(f64, @floatFromInt(k)) / n;
    }
}

pub fn preRequest(ev: *const sdk.PreRequest) sdk.Error!void {
    const hashes = try blockHashes(&ev.request);
    if (hashes.len == 0) return;
    // An endpoint not in the last snapshot gets the base capacity; the next snapshot
    // without it forgets it.
    const st = endpoints.get(ev.endpoint) orelse try epState(ev.endpoint, capacityOf(null));
    for (hashes) |h| try st.lru.insert(gpa, h);
}

// -- state for hot swap -----------------------------------------------------------------
// [1, block_size, max_blocks, [[address, bin(LE u64 hashes, least recent first)]…]]
// Hashes depend on block_size and max_blocks only through the prompt cut, so a state is
// refused when block_size differs.

const state_format: i64 = 1;

pub fn exportState(w: *sdk.Writer) sdk.Error!void {
    var total: usize = 64;
    var longest: usize = 0;
    var it = endpoints.iterator();
    while (it.next()) |kv| {
        total += 16 + kv.key_ptr.len + 8 * kv.value_ptr.*.lru.len;
        longest = @max(longest, kv.value_ptr.*.lru.len);
    }
    // One exact allocation: at full state this buffer is a quarter of the instance.
    try w.list.ensureTotalCapacityPrecise(gpa, total);
    try w.arrayHeader(4);
    try w.int(state_format);
    try w.int(cfg.block_size);
    try w.int(cfg.max_blocks);
    try w.arrayHeader(endpoints.count());
    // One staging buffer for all endpoints, not one each: 64 full LRUs would need 16 MB.
    const staging = try sdk.scratch().alloc(u64, longest);
    it = endpoints.iterator();
    while (it.next()) |kv| {
        const lru = &kv.value_ptr.*.lru;
        try w.arrayHeader(2);
        try w.str(kv.key_ptr.*);
        const hashes = staging[0..lru.len];
        lru.oldestFirst(hashes);
        for (hashes) |*h| h.* = std.mem.nativeToLittle(u64, h.*);
        try w.bin(std.mem.sliceAsBytes(hashes));
    }
}

pub fn importState(r: *sdk.Reader) sdk.Error!void {
    clearState();
    const n = try r.arrayLen("prefix-cache state");
    if (n != 4) return sdk.fail("prefix-cache state has {d} elements, expected 4", .{n});
    const fmt = try r.int("state format");
    if (fmt != state_format) return sdk.fail("prefix-cache state format {d} is not {d}", .{ fmt, state_format });
    const bs = try r.int("state block_size");
    if (bs != cfg.block_size) return sdk.fail("prefix-cache state was recorded with block_size {d}, this instance uses {d}", .{ bs, cfg.block_size });
    _ = try r.int("state max_blocks");
    const n_eps = try r.arrayLen("state endpoints");
    for (0..n_eps) |_| {
        const m = try r.arrayLen("state endpoint");
        if (m != 2) return sdk.fail("state endpoint has {d} elements, expected 2", .{m});
        const st = try epState(try r.str("state endpoint address"), capacityOf(null));
        const raw = try r.str("state endpoint hashes");
        if (raw.len % 8 != 0) return sdk.fail("state endpoint hashes are {d} bytes, not a multiple of 8", .{raw.len});
        try st.lru.reserveFor(gpa, raw.len / 8);
        var i: usize = 0;
        // export_state wrote each endpoint's distinct hashes: no lookups needed.
        while (i < raw.len) : (i += 8) try st.lru.insertNew(gpa, std.mem.readInt(u64, raw[i..][0..8], .little));
    }
}

comptime {
    sdk.exportPolicy(@This());
}
