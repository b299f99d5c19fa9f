//! The approximate prefix-cache estimate, shared by the prefix policies (prefix-cache, and
//! precise-prefix where an endpoint publishes no KV events): which endpoint likely holds a
//! prompt's leading blocks, guessed from the policy's own past picks.
//!
//! The prompt's UTF-8 bytes are cut into `block_size`-byte blocks (a trailing partial
//! block is ignored; at most `max_blocks` blocks). With xxh64, seed 0:
//!   h0 = xxh64(model ‖ block0)                        without a cache salt
//!   h0 = xxh64(model ‖ 0x00 ‖ cache_salt ‖ 0x00 ‖ block0)   with one
//!   hi = xxh64(block_i ‖ little-endian u64 of h(i−1))
//! The NUL bytes keep ("ab", salt "c") and ("a", salt "bc") apart; model names cannot
//! contain NUL (the host refuses control characters in them).
//! `record` (a policy's `pre_request`) inserts h0..h(n−1), in that order, into the picked
//! endpoint's LRU (so the last block is the most recently used); `matched` counts the
//! leading hashes present and never touches the LRUs. Endpoints that leave the snapshot
//! are forgotten. Capacity per endpoint: `lru_capacity`, or with
//! `capacity_from_gpu_blocks` min(num_gpu_blocks, lru_capacity) when the endpoint reports
//! num_gpu_blocks > 0.
//!
//! State for hot swap: [1, block_size, max_blocks, [[address, bin(LE u64 hashes, least
//! recent first)]…]]. Hashes depend on block_size and max_blocks only through the prompt
//! cut, so a state is refused when block_size differs.

const std = @import("std");
const abi = @import("abi.zig");
const report = @import("report.zig");
const msgpack = @import("msgpack.zig");
const lru_mod = @import("lru.zig");

pub const Lru = lru_mod.Lru;
pub const max_capacity = lru_mod.max_capacity;

const Error = report.Error;
const gpa: std.mem.Allocator = std.heap.wasm_allocator;

/// The estimate's params (a policy's Params carry the same names).
pub const Config = struct {
    block_size: i64 = 64,
    max_blocks: i64 = 256,
    lru_capacity: i64 = 31_250,
    capacity_from_gpu_blocks: bool = false,

    pub fn check(p: Config) Error!void {
        if (p.block_size < 1 or p.block_size > 1 << 20) return report.fail("param 'block_size': {d} is not in [1, 1048576]", .{p.block_size});
        if (p.max_blocks < 1 or p.max_blocks > 4096) return report.fail("param 'max_blocks': {d} is not in [1, 4096]", .{p.max_blocks});
        if (p.lru_capacity < 0 or p.lru_capacity > max_capacity) return report.fail("param 'lru_capacity': {d} is not in [0, {d}]", .{ p.lru_capacity, max_capacity });
    }
};

const EpState = struct {
    address: []u8,
    lru: Lru,
};

/// One estimate; `label` names its state in error messages (the policy's name).
pub fn Estimator(comptime label: []const u8) type {
    return struct {
        const Self = @This();

        cfg: Config = .{},
        endpoints: std.StringHashMapUnmanaged(*EpState) = .empty,
        // Snapshot index -> that endpoint's state (every snapshot endpoint has one).
        by_index: std.ArrayList(*EpState) = .empty,
        by_index_version: ?i64 = null,

        /// Configure and forget everything.
        pub fn reset(self: *Self, cfg: Config) void {
            self.cfg = cfg;
            self.clearState();
        }

        fn clearState(self: *Self) void {
            var it = self.endpoints.iterator();
            while (it.next()) |kv| freeEp(kv.value_ptr.*);
            self.endpoints.clearAndFree(gpa);
            self.by_index.clearAndFree(gpa);
            self.by_index_version = null;
        }

        fn freeEp(st: *EpState) void {
            st.lru.deinit(gpa);
            gpa.free(st.address);
            gpa.destroy(st);
        }

        fn capacityOf(self: *const Self, e: ?*const abi.Endpoint) u32 {
            const base: u32 = @intCast(self.cfg.lru_capacity);
            if (self.cfg.capacity_from_gpu_blocks) {
                if (e) |ep| if (ep.num_gpu_blocks > 0) return @intCast(@min(ep.num_gpu_blocks, base));
            }
            return base;
        }

        fn epState(self: *Self, address: []const u8, cap: u32) Error!*EpState {
            const gop = try self.endpoints.getOrPut(gpa, address);
            if (gop.found_existing) return gop.value_ptr.*;
            const st = gpa.create(EpState) catch |e| {
                self.endpoints.removeByPtr(gop.key_ptr);
                return e;
            };
            st.* = .{
                .address = gpa.dupe(u8, address) catch |e| {
                    gpa.destroy(st);
                    self.endpoints.removeByPtr(gop.key_ptr);
                    return e;
                },
                .lru = Lru.init(cap),
            };
            gop.key_ptr.* = st.address;
            gop.value_ptr.* = st;
            return st;
        }

        /// The request's block hashes, h0..h(n−1), in `scratch` memory.
        pub fn blockHashes(self: *const Self, scratch: std.mem.Allocator, q: *const abi.Request) Error![]u64 {
            const bs: usize = @intCast(self.cfg.block_size);
            const n = @min(q.prompt.len / bs, @as(usize, @intCast(self.cfg.max_blocks)));
            const out = try scratch.alloc(u64, n);
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

        /// A new pool view: forget endpoints that left; give every present one a state
        /// with the capacity its metrics imply. Its LRU starts small (512 hashes) and
        /// doubles as it fills: memory follows use, and a busy pool allocates up front
        /// rather than on its first requests.
        pub fn onSnapshot(self: *Self, scratch: std.mem.Allocator, snap: *const abi.Snapshot) Error!void {
            var present: std.StringHashMapUnmanaged(void) = .empty;
            try present.ensureTotalCapacity(scratch, @intCast(snap.endpoints.len));
            for (snap.endpoints) |*e| present.putAssumeCapacity(e.address, {});
            var gone: std.ArrayList(*EpState) = .empty;
            var it = self.endpoints.iterator();
            while (it.next()) |kv| {
                if (!present.contains(kv.key_ptr.*)) try gone.append(scratch, kv.value_ptr.*);
            }
            for (gone.items) |st| {
                _ = self.endpoints.remove(st.address);
                freeEp(st);
            }
            try self.by_index.resize(gpa, snap.endpoints.len);
            for (snap.endpoints, self.by_index.items) |*e, *slot| {
                const cap = self.capacityOf(e);
                const st = try self.epState(e.address, cap);
                if (st.lru.cap != cap) try st.lru.setCap(gpa, cap);
                try st.lru.reserve(gpa);
                slot.* = st;
            }
            self.by_index_version = snap.version;
        }

        /// Make the per-index states follow `snap` (an inline snapshot the SDK has not
        /// announced, or a first call).
        pub fn sync(self: *Self, scratch: std.mem.Allocator, snap: *const abi.Snapshot) Error!void {
            if (self.by_index_version != snap.version or self.by_index.items.len != snap.endpoints.len)
                try self.onSnapshot(scratch, snap);
        }

        /// Leading `hashes` present in the LRU of snapshot endpoint `index` (after `sync`).
        pub fn matched(self: *const Self, index: u32, hashes: []const u64) usize {
            const lru = &self.by_index.items[index].lru;
            var k: usize = 0;
            while (k < hashes.len and lru.contains(hashes[k])) k += 1;
            return k;
        }

        /// The host picked `ev.endpoint` for `ev.request`: it now likely holds the blocks.
        pub fn record(self: *Self, scratch: std.mem.Allocator, ev: *const abi.PreRequest) Error!void {
            const hashes = try self.blockHashes(scratch, &ev.request);
            if (hashes.len == 0) return;
            // An endpoint not in the last snapshot gets the base capacity; the next
            // snapshot without it forgets it.
            const st = self.endpoints.get(ev.endpoint) orelse try self.epState(ev.endpoint, self.capacityOf(null));
            for (hashes) |h| try st.lru.insert(gpa, h);
        }

        const state_format: i64 = 1;

        pub fn exportState(self: *Self, scratch: std.mem.Allocator, w: *msgpack.Writer) Error!void {
            var total: usize = 64;
            var longest: usize = 0;
            var it = self.endpoints.iterator();
            while (it.next()) |kv| {
                total += 16 + kv.key_ptr.len + 8 * kv.value_ptr.*.lru.len;
                longest = @max(longest, kv.value_ptr.*.lru.len);
            }
            // One exact allocation: at full state this buffer is a quarter of the instance.
            try w.list.ensureTotalCapacityPrecise(gpa, total);
            try w.arrayHeader(4);
            try w.int(state_format);
            try w.int(self.cfg.block_size);
            try w.int(self.cfg.max_blocks);
            try w.arrayHeader(self.endpoints.count());
            // One staging buffer for all endpoints, not one each: 64 full LRUs would need 16 MB.
            const staging = try scratch.alloc(u64, longest);
            it = self.endpoints.iterator();
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

        pub fn importState(self: *Self, r: *msgpack.Reader) Error!void {
            self.clearState();
            const n = try r.arrayLen(label ++ " state");
            if (n != 4) return report.fail(label ++ " state has {d} elements, expected 4", .{n});
            const fmt = try r.int("state format");
            if (fmt != state_format) return report.fail(label ++ " state format {d} is not {d}", .{ fmt, state_format });
            const bs = try r.int("state block_size");
            if (bs != self.cfg.block_size) return report.fail(label ++ " state was recorded with block_size {d}, this instance uses {d}", .{ bs, self.cfg.block_size });
            _ = try r.int("state max_blocks");
            const n_eps = try r.arrayLen("state endpoints");
            for (0..n_eps) |_| {
                const m = try r.arrayLen("state endpoint");
                if (m != 2) return report.fail("state endpoint has {d} elements, expected 2", .{m});
                const st = try self.epState(try r.str("state endpoint address"), self.capacityOf(null));
                const raw = try r.str("state endpoint hashes");
                if (raw.len % 8 != 0) return report.fail("state endpoint hashes are {d} bytes, not a multiple of 8", .{raw.len});
                try st.lru.reserveFor(gpa, raw.len / 8);
                var i: usize = 0;
                // export_state wrote each endpoint's distinct hashes: no lookups needed.
                while (i < raw.len) : (i += 8) try st.lru.insertNew(gpa, std.mem.readInt(u64, raw[i..][0..8], .little));
            }
        }
    };
}

/// Blocks an endpoint was recently picked for, each with the time of its last pick: what
/// its engine is about to cache before its KV events can say so (the events come when
/// the request is scheduled, after the frontend and the queue). A pick records only the
/// hashes of blocks 0–3, of every power-of-two block and of its last block (≤ 13 of 256):
/// the hashes chain, so a request whose block k hashes like a recorded one shares blocks
/// 0..k with that pick, and `matched` = 1 + the largest such k — exact up to block 4,
/// then rounded down to a sampled block (at worst by half). Two generations of at most
/// `cap / 2` hashes each: when the newer fills, the older is emptied and becomes the
/// newer, so between `cap / 2` and `cap` of the most recent are kept (no per-entry
/// removals: a hash table full of tombstones makes lookups slow). Entries older than the
/// caller's TTL are ignored by `matched`.
pub const Recent = struct {
    const Map = std.AutoHashMapUnmanaged(u64, i64);

    cap: u32,
    gens: [2]Map = .{ .empty, .empty },
    newer: u1 = 0,

    pub fn init(cap: u32) Recent {
        return .{ .cap = cap };
    }

    pub fn deinit(r: *Recent) void {
        for (&r.gens) |*m| m.deinit(gpa);
        r.* = init(r.cap);
    }

    fn sampled(i: usize, n: usize) bool {
        return i < 4 or (i & (i - 1)) == 0 or i + 1 == n;
    }

    /// `hashes` (a request's whole chain) were picked at `ms`.
    pub fn record(r: *Recent, hashes: []const u64, ms: i64) Error!void {
        if (r.cap == 0) return;
        const half = @max(r.cap / 2, 1);
        if (r.gens[0].capacity() == 0) {
            // Both generations at their final size at once: growing them step by step
            // would leave the smaller arrays behind as unusable gaps in linear memory.
            for (&r.gens) |*m| try m.ensureTotalCapacity(gpa, half);
        }
        for (hashes, 0..) |h, i| {
            if (!sampled(i, hashes.len)) continue;
            if (r.gens[r.newer].count() >= half) {
                r.newer ^= 1;
                r.gens[r.newer].clearRetainingCapacity();
            }
            try r.gens[r.newer].put(gpa, h, ms);
        }
    }

    fn lastPick(r: *const Recent, h: u64) ?i64 {
        return r.gens[r.newer].get(h) orelse r.gens[r.newer ^ 1].get(h);
    }

    /// Leading blocks of `hashes` (a request's chain) a pick here at or after `since_ms`
    /// shares, as far as the sampled blocks tell.
    pub fn matched(r: *const Recent, hashes: []const u64, since_ms: i64) usize {
        var k = hashes.len;
        while (k > 0) : (k -= 1) {
            if (r.lastPick(hashes[k - 1])) |ms| if (ms >= since_ms) return k;
        }
        return 0;
    }
};
