//! A set of u64 block hashes with least-recently-used eviction, O(1) per operation.
//!
//! Fixed arrays indexed by slot: `keys`, an intrusive doubly linked recency list
//! (`prev`/`next`, head = most recent) and hash chains (`buckets` → `chain`). Indices are
//! u16 — capacity ≤ 65,535 — which halves the memory of u32 links: at the default 31,250
//! hashes a full set takes 512 KiB, so 64 endpoints fit in 32 MiB. The arrays start small
//! and double as the set fills (memory follows use, not capacity), up to `cap`.

const std = @import("std");

pub const max_capacity: u32 = std.math.maxInt(u16);
const nil: u16 = std.math.maxInt(u16);
const initial_slots: u32 = 512;

const Allocator = std.mem.Allocator;

pub const Lru = struct {
    /// Most hashes kept; inserting beyond it evicts the least recently used.
    cap: u32,
    len: u32 = 0,
    head: u16 = nil,
    tail: u16 = nil,
    keys: []u64 = &.{},
    prev: []u16 = &.{},
    next: []u16 = &.{},
    chain: []u16 = &.{},
    buckets: []u16 = &.{},

    pub fn init(cap: u32) Lru {
        return .{ .cap = @min(cap, max_capacity) };
    }

    pub fn deinit(l: *Lru, gpa: Allocator) void {
        gpa.free(l.keys);
        gpa.free(l.prev);
        gpa.free(l.next);
        gpa.free(l.chain);
        gpa.free(l.buckets);
        l.* = init(l.cap);
    }

    /// Bytes of linear memory the set's arrays occupy (as allocated, not as used).
    pub fn bytes(l: *const Lru) usize {
        return l.keys.len * 8 + (l.prev.len + l.next.len + l.chain.len + l.buckets.len) * 2;
    }

    fn bucketOf(l: *const Lru, key: u64) usize {
        // xxh64 output is uniform: its low bits make a fine bucket index.
        return @intCast(key & (l.buckets.len - 1));
    }

    fn find(l: *const Lru, key: u64) ?u16 {
        if (l.len == 0) return null;
        var i = l.buckets[l.bucketOf(key)];
        while (i != nil) : (i = l.chain[i]) {
            if (l.keys[i] == key) return i;
        }
        return null;
    }

    pub fn contains(l: *const Lru, key: u64) bool {
        return l.find(key) != null;
    }

    fn unlinkList(l: *Lru, i: u16) void {
        const p = l.prev[i];
        const n = l.next[i];
        if (p != nil) l.next[p] = n else l.head = n;
        if (n != nil) l.prev[n] = p else l.tail = p;
    }

    fn pushFront(l: *Lru, i: u16) void {
        l.prev[i] = nil;
        l.next[i] = l.head;
        if (l.head != nil) l.prev[l.head] = i;
        l.head = i;
        if (l.tail == nil) l.tail = i;
    }

    fn unlinkChain(l: *Lru, i: u16) void {
        const b = l.bucketOf(l.keys[i]);
        if (l.buckets[b] == i) {
            l.buckets[b] = l.chain[i];
            return;
        }
        var j = l.buckets[b];
        while (l.chain[j] != i) j = l.chain[j];
        l.chain[j] = l.chain[i];
    }

    fn linkChain(l: *Lru, i: u16) void {
        const b = l.bucketOf(l.keys[i]);
        l.chain[i] = l.buckets[b];
        l.buckets[b] = i;
    }

    /// Drop the least recently used hash; returns its slot.
    fn evict(l: *Lru) u16 {
        const i = l.tail;
        l.unlinkList(i);
        l.unlinkChain(i);
        l.len -= 1;
        return i;
    }

    /// Change the capacity (the endpoint's num_gpu_blocks changed). Lowering it below the
    /// current size keeps the `cap` most recent hashes, compacted into slots 0..cap-1.
    pub fn setCap(l: *Lru, gpa: Allocator, cap: u32) Allocator.Error!void {
        const new_cap = @min(cap, max_capacity);
        if (new_cap >= l.len) {
            l.cap = new_cap;
            return;
        }
        const kept = try gpa.alloc(u64, l.len);
        defer gpa.free(kept);
        l.oldestFirst(kept);
        l.cap = new_cap;
        l.len = 0;
        l.head = nil;
        l.tail = nil;
        @memset(l.buckets, nil);
        for (kept[kept.len - new_cap ..]) |key| try l.insert(gpa, key);
    }

    /// Reallocate the arrays to `slots` (> their length, ≤ cap) slots.
    fn growTo(l: *Lru, gpa: Allocator, slots: u32) Allocator.Error!void {
        const n_buckets = std.math.ceilPowerOfTwoAssert(u32, @max(16, slots / 2));
        const keys = try gpa.alloc(u64, slots);
        errdefer gpa.free(keys);
        const prev = try gpa.alloc(u16, slots);
        errdefer gpa.free(prev);
        const next = try gpa.alloc(u16, slots);
        errdefer gpa.free(next);
        const chain = try gpa.alloc(u16, slots);
        errdefer gpa.free(chain);
        const buckets = try gpa.alloc(u16, n_buckets);
        // Slots keep their numbers: copy keys and recency links, rebuild the chains.
        const used = l.keys.len;
        @memcpy(keys[0..used], l.keys);
        @memcpy(prev[0..used], l.prev);
        @memcpy(next[0..used], l.next);
        l.deinitArrays(gpa);
        l.keys = keys;
        l.prev = prev;
        l.next = next;
        l.chain = chain;
        l.buckets = buckets;
        @memset(buckets, nil);
        var i = l.head;
        while (i != nil) : (i = l.next[i]) l.linkChain(i);
    }

    fn deinitArrays(l: *Lru, gpa: Allocator) void {
        gpa.free(l.keys);
        gpa.free(l.prev);
        gpa.free(l.next);
        gpa.free(l.chain);
        gpa.free(l.buckets);
    }

    /// Allocate the first, small arrays now (for an endpoint that joined the pool), so
    /// that recording its first request does not allocate.
    pub fn reserve(l: *Lru, gpa: Allocator) Allocator.Error!void {
        if (l.keys.len == 0 and l.cap > 0) try l.growTo(gpa, @min(l.cap, initial_slots));
    }

    /// Make room for `n` hashes at once (bulk loads), instead of doubling step by step.
    pub fn reserveFor(l: *Lru, gpa: Allocator, n: usize) Allocator.Error!void {
        const want: u32 = @intCast(@min(n, l.cap));
        if (want > l.keys.len) try l.growTo(gpa, @max(want, @min(l.cap, initial_slots)));
    }

    /// Insert `key` as the most recently used (moving it there if present).
    pub fn insert(l: *Lru, gpa: Allocator, key: u64) Allocator.Error!void {
        if (l.cap == 0) return;
        if (l.find(key)) |i| {
            l.unlinkList(i);
            l.pushFront(i);
            return;
        }
        return l.insertNew(gpa, key);
    }

    /// Insert a key known to be absent (bulk loads of exported state). Were it present
    /// after all, the set would hold it twice — wasting a slot, never breaking a link:
    /// every unlink is by slot.
    pub fn insertNew(l: *Lru, gpa: Allocator, key: u64) Allocator.Error!void {
        if (l.cap == 0) return;
        const slot: u16 = blk: {
            if (l.len == l.cap) break :blk l.evict();
            // Invariant: the taken slots are exactly 0..len-1 (an eviction frees a slot
            // that is reused at once; setCap compacts), so the next free slot is `len`.
            if (l.len == l.keys.len) try l.growTo(gpa, @min(l.cap, @max(initial_slots, 2 * l.len)));
            break :blk @intCast(l.len);
        };
        l.keys[slot] = key;
        l.linkChain(slot);
        l.pushFront(slot);
        l.len += 1;
    }

    /// Hashes from least to most recently used (for export_state).
    pub fn oldestFirst(l: *const Lru, out: []u64) void {
        var i = l.tail;
        var k: usize = 0;
        while (i != nil) : (i = l.prev[i]) {
            out[k] = l.keys[i];
            k += 1;
        }
    }
};
