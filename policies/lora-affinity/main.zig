//! lora-affinity — prefer endpoints that already hold the request's LoRA adapter
//! (docs/scoring.md, "lora-affinity"; seeds 000 and 002).
//!
//! Profile "seed" (default), per endpoint, first match wins:
//!   base-model request (no adapter)                 → 1.0 everywhere
//!   A ∈ R and W = ∅                                  → score_running   (1.0)
//!   |R ∪ W| < M                                      → score_room      (0.75)
//!   W ≠ ∅ and M > 0                                  → score_waiting_max × (1 − min(|W|, M)/M)
//!   otherwise                                        → score_other     (0.0)
//! R = scraped running ∪ adapters with in-flight requests in this policy's history on that
//! endpoint; W = scraped waiting; M = max_lora; set sizes count distinct names.
//! While the endpoint defers requests for want of a LoRA slot (`deferred` > 0, current
//! vLLM, which names no waiting adapter): R = scraped running only, and W = scraped
//! waiting ∪ in-flight history adapters the engine does not list — or, if that is empty,
//! one unnamed adapter (someone else's deferred request).
//!
//! Profile "upstream" (the Go picker's table, no history, no base-model rule):
//!   A ∈ scraped running → 1.0; |running| + |waiting| < M → 0.8; A ∈ waiting → 0.6; else 0.
//!
//! History: `pre_request` adds one in-flight request for (adapter, endpoint);
//! `post_response` removes it — by request_id when the id is known (so a repeated report
//! is a no-op), by (adapter, endpoint) when the id is empty, never below zero. Unknown ids
//! are ignored. Reconcile, at most once per `reconcile_interval_ms` of snapshot time:
//! an entry whose adapter the endpoint reports neither running nor waiting and whose last
//! pre_request is older than the interval is dropped, as are request records older than
//! `request_ttl_ms` (lost completion reports). Endpoints that leave the snapshot are
//! forgotten on every snapshot.

const std = @import("std");
const sdk = @import("epick");

pub const name = "lora-affinity";
pub const version = "1.0.0";
pub const kind = "lora-affinity";
pub const panic = sdk.panic;

pub const Profile = enum { seed, upstream };

pub const Params = struct {
    profile: Profile = .seed,
    score_running: f64 = 1.0,
    score_room: f64 = 0.75,
    score_waiting_max: f64 = 0.5,
    score_other: f64 = 0.0,
    use_history: bool = true,
    reconcile_interval_ms: i64 = 1000,
    request_ttl_ms: i64 = 600_000,
    /// Affinity bounded by load (profile "seed"): a candidate whose work (ctx.work)
    /// exceeds the least-loaded candidate's by more than this drops from the running tier
    /// to the room tier, so an idle replica that can load the adapter wins. Negative = never.
    max_imbalance: i64 = 16,

    pub fn check(p: *const Params) sdk.Error!void {
        const tiers = .{ "score_running", "score_room", "score_waiting_max", "score_other" };
        const defaults: Params = .{};
        inline for (tiers) |t| {
            const v = @field(p, t);
            if (!(v >= 0 and v <= 1)) return sdk.fail("param '" ++ t ++ "': {d} is not in [0, 1]", .{v});
            if (p.profile == .upstream and v != @field(defaults, t))
                return sdk.fail("param '" ++ t ++ "' applies to profile 'seed' only (profile 'upstream' has fixed tiers 1.0/0.8/0.6/0)", .{});
        }
        if (p.reconcile_interval_ms < 0) return sdk.fail("param 'reconcile_interval_ms': {d} must be >= 0", .{p.reconcile_interval_ms});
        if (p.request_ttl_ms <= 0) return sdk.fail("param 'request_ttl_ms': {d} must be > 0", .{p.request_ttl_ms});
    }
};

/// In-flight history of one adapter on one endpoint.
const Hist = struct { inflight: u32 = 0, last_pre_ms: i64 = 0 };

const EpState = struct {
    address: []u8,
    /// Adapter name (owned) -> its history here.
    adapters: std.StringHashMapUnmanaged(Hist) = .empty,
    /// Sum of `inflight` over `adapters`: 0 lets scoring skip the map.
    inflight: u32 = 0,
};

/// A request picked and not yet reported complete (for idempotent post_response). It
/// points into the history it counts in, so recording one allocates nothing.
const ReqRec = struct {
    ep: *EpState,
    /// The key slice owned by `ep.adapters`.
    adapter: []const u8,
    at_ms: i64,
};

const gpa = sdk.gpa;

var cfg: Params = .{};
/// Address (owned by the EpState) -> its history.
var endpoints: std.StringHashMapUnmanaged(*EpState) = .empty;
/// Request id, hashed (64-bit: collisions among in-flight ids are negligible) -> record.
/// An array hash map deletes without tombstones: this one churns on every request.
var requests: std.AutoArrayHashMapUnmanaged(u64, ReqRec) = .empty;
var last_reconcile_ms: ?i64 = null;

// Snapshot index -> that endpoint's history, rebuilt when the snapshot or the set of
// endpoints with history changes: scoring then does no string hashing.
var by_index: std.ArrayList(*EpState) = .empty;
var by_index_version: ?i64 = null;
var by_index_dirty = true;

pub fn init(p: *const Params) sdk.Error!void {
    cfg = p.*;
    clearState();
}

fn clearState() void {
    requests.clearAndFree(gpa);
    var it = endpoints.iterator();
    while (it.next()) |kv| freeEp(kv.value_ptr.*);
    endpoints.clearAndFree(gpa);
    by_index.clearAndFree(gpa);
    by_index_version = null;
    by_index_dirty = true;
    last_reconcile_ms = null;
}

fn freeEp(st: *EpState) void {
    var it = st.adapters.iterator();
    while (it.next()) |kv| gpa.free(kv.key_ptr.*);
    st.adapters.deinit(gpa);
    gpa.free(st.address);
    gpa.destroy(st);
}

fn idHash(id: []const u8) u64 {
    return std.hash.Wyhash.hash(0, id);
}

// -- history ---------------------------------------------------------------------------

fn epState(address: []const u8) sdk.Error!*EpState {
    const gop = try endpoints.getOrPut(gpa, address);
    if (gop.found_existing) return gop.value_ptr.*;
    errdefer endpoints.removeByPtr(gop.key_ptr);
    const st = try gpa.create(EpState);
    errdefer gpa.destroy(st);
    st.* = .{ .address = try gpa.dupe(u8, address) };
    errdefer gpa.free(st.address);
    try st.adapters.ensureTotalCapacity(gpa, 8);
    gop.key_ptr.* = st.address;
    gop.value_ptr.* = st;
    by_index_dirty = true;
    return st;
}

const HistRef = struct { key: []const u8, hist: *Hist };

fn hist(st: *EpState, adapter: []const u8) sdk.Error!HistRef {
    const gop = try st.adapters.getOrPut(gpa, adapter);
    if (!gop.found_existing) {
        gop.key_ptr.* = gpa.dupe(u8, adapter) catch |e| {
            st.adapters.removeByPtr(gop.key_ptr);
            return e;
        };
        gop.value_ptr.* = .{};
    }
    return .{ .key = gop.key_ptr.*, .hist = gop.value_ptr };
}

/// The one place an in-flight count goes down (never below zero).
fn decrement(endpoint: []const u8, adapter: []const u8) void {
    const st = endpoints.get(endpoint) orelse return;
    const h = st.adapters.getPtr(adapter) orelse return;
    if (h.inflight > 0) {
        h.inflight -= 1;
        st.inflight -= 1;
    }
}

pub fn preRequest(ev: *const sdk.PreRequest) sdk.Error!void {
    if (!cfg.use_history or cfg.profile == .upstream) return;
    const adapter = ev.request.adapter;
    if (adapter.len == 0 or ev.endpoint.len == 0) return;
    const id = ev.request.request_id;
    // The same id picked again (a gateway retry): the earlier pick is void.
    if (id.len > 0) if (requests.fetchSwapRemove(idHash(id))) |old| decrement(old.value.ep.address, old.value.adapter);
    const st = try epState(ev.endpoint);
    const ref = try hist(st, adapter);
    ref.hist.inflight += 1;
    ref.hist.last_pre_ms = ev.timestamp_ms;
    st.inflight += 1;
    if (id.len > 0) try requests.put(gpa, idHash(id), .{ .ep = st, .adapter = ref.key, .at_ms = ev.timestamp_ms });
}

pub fn postResponse(ev: *const sdk.PostResponse) sdk.Error!void {
    if (ev.request_id.len > 0) {
        // Known id: undo exactly its pre_request, once. Unknown id: nothing to undo.
        if (requests.fetchSwapRemove(idHash(ev.request_id))) |kv| decrement(kv.value.ep.address, kv.value.adapter);
        return;
    }
    if (ev.adapter.len == 0) return;
    decrement(ev.endpoint, ev.adapter);
}

// -- snapshots and reconcile ------------------------------------------------------------

pub fn onSnapshot(snap: *const sdk.Snapshot) sdk.Error!void {
    try forgetDeparted(snap);
    const due = if (last_reconcile_ms) |t| snap.timestamp_ms - t >= cfg.reconcile_interval_ms else true;
    if (due) {
        try reconcile(snap);
        last_reconcile_ms = snap.timestamp_ms;
    }
    try rebuildIndex(snap);
}

/// Remove the request records `drop` selects (swap-remove: indices shift onto `i`).
fn dropRecords(ctx: anytype, comptime drop: fn (@TypeOf(ctx), *const ReqRec) bool, undo: bool) void {
    var i: usize = 0;
    while (i < requests.count()) {
        const rec = &requests.values()[i];
        if (drop(ctx, rec)) {
            if (undo) decrement(rec.ep.address, rec.adapter);
            requests.swapRemoveAt(i);
        } else i += 1;
    }
}

fn forgetDeparted(snap: *const sdk.Snapshot) sdk.Error!void {
    if (endpoints.count() == 0) return;
    var present: std.StringHashMapUnmanaged(void) = .empty;
    try present.ensureTotalCapacity(sdk.scratch(), @intCast(snap.endpoints.len));
    for (snap.endpoints) |*e| present.putAssumeCapacity(e.address, {});
    var gone: std.AutoHashMapUnmanaged(*EpState, void) = .empty;
    var it = endpoints.iterator();
    while (it.next()) |kv| {
        if (!present.contains(kv.key_ptr.*)) try gone.put(sdk.scratch(), kv.value_ptr.*, {});
    }
    if (gone.count() == 0) return;
    // Their request records go too: a late post_response for them is then "unknown".
    dropRecords(&gone, struct {
        fn f(g: *std.AutoHashMapUnmanaged(*EpState, void), rec: *const ReqRec) bool {
            return g.contains(rec.ep);
        }
    }.f, false);
    var git = gone.keyIterator();
    while (git.next()) |st| {
        _ = endpoints.remove(st.*.address);
        freeEp(st.*);
    }
    by_index_dirty = true;
}

fn reconcile(snap: *const sdk.Snapshot) sdk.Error!void {
    const now = snap.timestamp_ms;
    // Lost completion reports: request records past their TTL stop counting.
    dropRecords(now, struct {
        fn f(t: i64, rec: *const ReqRec) bool {
            return t - rec.at_ms > cfg.request_ttl_ms;
        }
    }.f, true);
    // History the endpoint's metrics no longer back, and that no recent pick renewed.
    for (snap.endpoints) |*e| {
        const st = endpoints.get(e.address) orelse continue;
        var drop: std.ArrayList([]const u8) = .empty;
        var it = st.adapters.iterator();
        while (it.next()) |kv| {
            const a = kv.key_ptr.*;
            if (e.isRunning(a) or e.isWaiting(a)) continue;
            if (now - kv.value_ptr.last_pre_ms > cfg.reconcile_interval_ms) try drop.append(sdk.scratch(), a);
        }
        for (drop.items) |a| dropHistory(st, a);
    }
}

fn dropHistory(st: *EpState, adapter: []const u8) void {
    // Records counting in the entry must not dangle: they go with it.
    const Which = struct { st: *EpState, key: []const u8 };
    dropRecords(Which{ .st = st, .key = adapter }, struct {
        fn f(w: Which, rec: *const ReqRec) bool {
            return rec.ep == w.st and rec.adapter.ptr == w.key.ptr;
        }
    }.f, false);
    const kv = st.adapters.fetchRemove(adapter).?;
    st.inflight -= kv.value.inflight;
    gpa.free(kv.key);
}

fn rebuildIndex(snap: *const sdk.Snapshot) sdk.Error!void {
    try by_index.resize(gpa, snap.endpoints.len);
    // Every endpoint in the pool gets its (small) history up front, so the request path
    // allocates only for adapters it has not seen there.
    for (snap.endpoints, by_index.items) |*e, *slot| slot.* = try epState(e.address);
    by_index_version = snap.version;
    by_index_dirty = false;
}

// -- scoring ----------------------------------------------------------------------------

/// Distinct names across the lists (and the history's in-flight adapters, when given).
fn distinct(lists: []const []const []const u8, extra: ?*const EpState) u32 {
    var n: u32 = 0;
    for (lists, 0..) |list, li| {
        for (list, 0..) |a, ai| {
            if (seenBefore(lists, li, ai, a)) continue;
            n += 1;
        }
    }
    if (extra) |st| {
        var it = st.adapters.iterator();
        while (it.next()) |kv| {
            if (kv.value_ptr.inflight == 0) continue;
            if (seenBefore(lists, lists.len, 0, kv.key_ptr.*)) continue;
            n += 1;
        }
    }
    return n;
}

/// Whether `a` occurs in `lists` before position (li, ai).
fn seenBefore(lists: []const []const []const u8, li: usize, ai: usize, a: []const u8) bool {
    for (lists, 0..) |list, lj| {
        if (lj > li) break;
        const end = if (lj == li) ai else list.len;
        if (sdk.contains(list[0..end], a)) return true;
    }
    return false;
}

fn seedScore(e: *const sdk.Endpoint, st: ?*const EpState, adapter: []const u8) f64 {
    if (adapter.len == 0) return 1.0;
    // Current vLLM names no waiting adapter; it counts requests deferred for want of a
    // slot. While it defers, the adapters this policy sent there that the engine does not
    // list as resident are the ones waiting (docs/design.md, "LoRA affinity on current vLLM").
    const deferring = e.deferred > 0;
    const in_history = if (st) |s| (if (s.adapters.get(adapter)) |h| h.inflight > 0 else false) else false;
    const in_r = e.isRunning(adapter) or (in_history and !deferring);
    var w = distinct(&.{e.waiting_adapters}, null);
    var anonymous: u32 = 0;
    if (deferring) {
        if (st) |s| w += historyOutside(s, &.{ e.running_adapters, e.waiting_adapters });
        // Deferred requests of adapters someone else sent: at least one adapter waits.
        if (w == 0) anonymous = 1;
        w += anonymous;
    }
    if (in_r and w == 0) return cfg.score_running;
    const r_or_w = distinct(&.{ e.running_adapters, e.waiting_adapters }, st) + anonymous;
    if (r_or_w < e.max_lora) return cfg.score_room;
    if (w > 0 and e.max_lora > 0) {
        const m: f64 = @floatFromInt(e.max_lora);
        const wf: f64 = @floatFromInt(@min(@as(i64, w), e.max_lora));
        return cfg.score_waiting_max * (1.0 - wf / m);
    }
    return cfg.score_other;
}

/// In-flight adapters of the history that none of `lists` names.
fn historyOutside(st: *const EpState, lists: []const []const []const u8) u32 {
    var n: u32 = 0;
    var it = st.adapters.iterator();
    while (it.next()) |kv| {
        if (kv.value_ptr.inflight == 0) continue;
        if (seenBefore(lists, lists.len, 0, kv.key_ptr.*)) continue;
        n += 1;
    }
    return n;
}

fn upstreamScore(e: *const sdk.Endpoint, adapter: []const u8) f64 {
    if (e.isRunning(adapter)) return 1.0;
    if (@as(i64, @intCast(e.running_adapters.len + e.waiting_adapters.len)) < e.max_lora) return 0.8;
    if (e.isWaiting(adapter)) return 0.6;
    return 0.0;
}

pub fn score(ctx: *const sdk.ScoreCtx, out: []f64) sdk.Error!void {
    const adapter = ctx.request.adapter;
    if (cfg.profile == .upstream) {
        for (out, 0..) |*o, i| o.* = upstreamScore(ctx.endpoint(i), adapter);
        return;
    }
    const history = cfg.use_history and endpoints.count() > 0;
    if (history and (by_index_dirty or by_index_version != ctx.snapshot.version or by_index.items.len != ctx.snapshot.endpoints.len))
        try rebuildIndex(ctx.snapshot);
    const min_work = if (cfg.max_imbalance >= 0) ctx.minWork() else 0;
    for (out, ctx.candidates, 0..) |*o, c, i| {
        const st: ?*const EpState = if (history and by_index.items[c].inflight > 0) by_index.items[c] else null;
        o.* = seedScore(&ctx.snapshot.endpoints[c], st, adapter);
        if (adapter.len > 0 and cfg.max_imbalance >= 0 and o.* > cfg.score_room and ctx.work(i) - min_work > cfg.max_imbalance)
            o.* = cfg.score_room;
    }
}

// -- state for hot swap -----------------------------------------------------------------
// [1, last_reconcile_ms?, [[endpoint, [[adapter, inflight, last_pre_ms]…]]…],
//  [[request_id_hash, endpoint, adapter, at_ms]…]]

const state_format: i64 = 1;

pub fn exportState(w: *sdk.Writer) sdk.Error!void {
    try w.arrayHeader(4);
    try w.int(state_format);
    if (last_reconcile_ms) |t| try w.int(t) else try w.nil();
    try w.arrayHeader(endpoints.count());
    var it = endpoints.iterator();
    while (it.next()) |kv| {
        try w.arrayHeader(2);
        try w.str(kv.key_ptr.*);
        const st = kv.value_ptr.*;
        try w.arrayHeader(st.adapters.count());
        var ait = st.adapters.iterator();
        while (ait.next()) |a| {
            try w.arrayHeader(3);
            try w.str(a.key_ptr.*);
            try w.int(a.value_ptr.inflight);
            try w.int(a.value_ptr.last_pre_ms);
        }
    }
    try w.arrayHeader(@intCast(requests.count()));
    for (requests.keys(), requests.values()) |id, rec| {
        try w.arrayHeader(4);
        try w.uint(id);
        try w.str(rec.ep.address);
        try w.str(rec.adapter);
        try w.int(rec.at_ms);
    }
}

fn fixedArray(r: *sdk.Reader, comptime what: []const u8, n: u32) sdk.Error!void {
    const got = try r.arrayLen(what);
    if (got != n) return sdk.fail(what ++ " has {d} elements, expected {d}", .{ got, n });
}

pub fn importState(r: *sdk.Reader) sdk.Error!void {
    clearState();
    try fixedArray(r, "lora-affinity state", 4);
    const fmt = try r.int("state format");
    if (fmt != state_format) return sdk.fail("lora-affinity state format {d} is not {d}", .{ fmt, state_format });
    last_reconcile_ms = if (r.nil()) null else try r.int("state last_reconcile_ms");
    const n_eps = try r.arrayLen("state endpoints");
    for (0..n_eps) |_| {
        try fixedArray(r, "state endpoint", 2);
        const st = try epState(try r.str("state endpoint address"));
        const n_ad = try r.arrayLen("state endpoint adapters");
        for (0..n_ad) |_| {
            try fixedArray(r, "state adapter entry", 3);
            const ref = try hist(st, try r.str("state adapter name"));
            const inflight = try r.int("state adapter inflight");
            const count = std.math.cast(u32, inflight) orelse return sdk.fail("state adapter inflight {d} is out of range", .{inflight});
            st.inflight -= ref.hist.inflight; // a repeated entry replaces the earlier one
            ref.hist.inflight = count;
            st.inflight += count;
            ref.hist.last_pre_ms = try r.int("state adapter last_pre_ms");
        }
    }
    const n_req = try r.arrayLen("state requests");
    for (0..n_req) |_| {
        try fixedArray(r, "state request", 4);
        const id = try r.uint64("state request id");
        const st = try epState(try r.str("state request endpoint"));
        const ref = try hist(st, try r.str("state request adapter"));
        const at_ms = try r.int("state request at_ms");
        const gop = try requests.getOrPut(gpa, id);
        if (gop.found_existing) return sdk.fail("state request id {d} appears twice", .{id});
        gop.value_ptr.* = .{ .ep = st, .adapter = ref.key, .at_ms = at_ms };
    }
    by_index_dirty = true;
}

comptime {
    sdk.exportPolicy(@This());
}
