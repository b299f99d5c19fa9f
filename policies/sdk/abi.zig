//! The ABI payloads (policies/ABI.md, host/abi.py), decoded.
//!
//! Each layout is a msgpack array; elements the host sends beyond the ones known here are
//! skipped (layouts only grow at the end) and missing trailing elements take the defaults
//! host/abi.py declares. Strings either alias the input (`copy = false`: valid for the
//! call only) or are copied into the given arena (`copy = true`: the resident snapshot).

const std = @import("std");
const msgpack = @import("msgpack.zig");
const report = @import("report.zig");

const Allocator = std.mem.Allocator;
const Reader = msgpack.Reader;
pub const Error = report.Error;

pub const Criticality = struct {
    pub const critical: i64 = 0;
    pub const standard: i64 = 1;
    pub const sheddable: i64 = 2;
};

pub const Endpoint = struct {
    address: []const u8 = "",
    waiting: i64 = 0,
    running: i64 = 0,
    kv_usage: f64 = 0,
    running_adapters: []const []const u8 = &.{},
    waiting_adapters: []const []const u8 = &.{},
    max_lora: i64 = 0,
    num_gpu_blocks: i64 = 0,
    block_size: i64 = 0,
    /// Requests waiting for a free LoRA slot (or another transient constraint).
    deferred: i64 = 0,

    pub fn isRunning(e: *const Endpoint, adapter: []const u8) bool {
        return contains(e.running_adapters, adapter);
    }

    pub fn isWaiting(e: *const Endpoint, adapter: []const u8) bool {
        return contains(e.waiting_adapters, adapter);
    }
};

pub fn contains(names: []const []const u8, name: []const u8) bool {
    for (names) |n| {
        if (std.mem.eql(u8, n, name)) return true;
    }
    return false;
}

pub const Snapshot = struct {
    schema: i64 = 1,
    version: i64 = 0,
    timestamp_ms: i64 = 0,
    endpoints: []const Endpoint = &.{},

    /// The index of the endpoint with this address, if it is in the pool.
    pub fn find(s: *const Snapshot, address: []const u8) ?usize {
        for (s.endpoints, 0..) |*e, i| {
            if (std.mem.eql(u8, e.address, address)) return i;
        }
        return null;
    }
};

pub const Header = struct { name: []const u8, value: []const u8 };

pub const Request = struct {
    request_id: []const u8 = "",
    model: []const u8 = "",
    adapter: []const u8 = "",
    prompt: []const u8 = "",
    criticality: i64 = Criticality.standard,
    seed: u64 = 0,
    cache_salt: []const u8 = "",
    headers: []const Header = &.{},
    /// Time-to-first-token objective in ms; 0 = none.
    slo_ttft_ms: i64 = 0,
    /// Time-per-output-token objective in ms; 0 = none.
    slo_tpot_ms: i64 = 0,
    /// The prompt's tokens (the gateway's count or the host's estimate).
    prompt_tokens: i64 = 0,
    /// The conversation the request belongs to; empty = none.
    session_id: []const u8 = "",

    /// The value of a header (exact name match), if the gateway passed it.
    pub fn header(q: *const Request, name: []const u8) ?[]const u8 {
        for (q.headers) |h| {
            if (std.mem.eql(u8, h.name, name)) return h.value;
        }
        return null;
    }
};

pub const PreRequest = struct {
    request: Request = .{},
    endpoint: []const u8 = "",
    timestamp_ms: i64 = 0,
};

pub const PostResponse = struct {
    request_id: []const u8 = "",
    adapter: []const u8 = "",
    endpoint: []const u8 = "",
    status: i64 = 0,
    timestamp_ms: i64 = 0,
    model: []const u8 = "",
    /// Time to first token the gateway measured, in ms; negative = not reported.
    ttft_ms: f64 = -1,
    /// The engine's usage counts; negative = not reported.
    prompt_tokens: i64 = -1,
    completion_tokens: i64 = -1,
};

/// One `score`/`filter` call: the request, its candidates and the snapshot they index.
pub const ScoreCtx = struct {
    snapshot: *const Snapshot,
    request: Request,
    /// Indices into `snapshot.endpoints`, checked to be in range.
    candidates: []const u32,
    /// Per candidate (or empty = all 0): requests the host picked it for, not yet complete.
    in_flight: []const i64 = &.{},
    /// Per candidate (or empty = all 0): picks since its last good scrape.
    picked_since_scrape: []const i64 = &.{},
    /// Per candidate (or empty = not computed): full KV blocks in the request as that
    /// endpoint's engine hashes them (from the host's KV-event index).
    prefix_blocks: []const i64 = &.{},
    /// Per candidate (or empty = all -1): leading request blocks the endpoint's KV-cache
    /// events say it holds; -1 = no event stream or an uncertain index.
    prefix_matched: []const i64 = &.{},
    /// Per candidate (or empty = all 0): Unix ms (the host's clock, as snapshot.timestamp_ms
    /// and pre_request's timestamp_ms) its KV index was last emptied; 0 = never.
    prefix_cleared_ms: []const i64 = &.{},
    /// Per candidate (or empty = not computed): prompt tokens its engine would prefill,
    /// by its KV-cache events; -1 = unknown there.
    uncached_tokens: []const i64 = &.{},
    /// The snapshot is the resident one (`set_snapshot`): the same object, with the same
    /// endpoints, until the next `onSnapshot`, so what a policy derives from it may be
    /// kept until then. False: inline in this call's input (a later inline snapshot of the
    /// same version may hold other endpoints).
    resident: bool = false,

    /// The endpoint of the i-th candidate.
    pub fn endpoint(c: *const ScoreCtx, i: usize) *const Endpoint {
        return &c.snapshot.endpoints[c.candidates[i]];
    }

    /// Requests the i-th candidate has, by the best evidence: its scraped running + waiting
    /// plus the picks its scrape cannot show yet (those still in flight, when the host
    /// sends in-flight counts), or the host's in-flight count if larger.
    pub fn work(c: *const ScoreCtx, i: usize) i64 {
        const e = c.endpoint(i);
        var unseen: i64 = if (i < c.picked_since_scrape.len) @max(c.picked_since_scrape[i], 0) else 0;
        const inflight: i64 = if (i < c.in_flight.len) @max(c.in_flight[i], 0) else 0;
        if (c.in_flight.len > 0) unseen = @min(unseen, inflight); // a finished pick is no load
        const seen = @as(i64, @max(e.running, 0)) +| @max(e.waiting, 0) +| unseen;
        return @max(seen, inflight);
    }

    /// Full KV blocks of the request as the i-th candidate's engine hashes them; null
    /// when the host did not compute them (no KV events configured).
    pub fn prefixBlocks(c: *const ScoreCtx, i: usize) ?u32 {
        if (i >= c.prefix_blocks.len or c.prefix_blocks[i] < 0) return null;
        return @intCast(@min(c.prefix_blocks[i], std.math.maxInt(u32)));
    }

    /// Leading request blocks the i-th candidate's own KV-cache events say it holds
    /// (at most `prefixBlocks(i)`); null when it has no event stream, its index is
    /// uncertain, or the blocks were not computed — fall back to an estimate then.
    pub fn prefixMatched(c: *const ScoreCtx, i: usize) ?u32 {
        const blocks = c.prefixBlocks(i) orelse return null;
        if (i >= c.prefix_matched.len or c.prefix_matched[i] < 0) return null;
        return @intCast(@min(c.prefix_matched[i], blocks));
    }

    /// When the i-th candidate's KV index was last emptied (AllBlocksCleared, an engine
    /// restart, a rebuild after a gap), in the host's ms; null = never or not sent.
    pub fn prefixClearedMs(c: *const ScoreCtx, i: usize) ?i64 {
        if (i >= c.prefix_cleared_ms.len or c.prefix_cleared_ms[i] <= 0) return null;
        return c.prefix_cleared_ms[i];
    }

    /// Prompt tokens the i-th candidate would prefill, by its engine's KV-cache events;
    /// null when unknown (no events, an uncertain index) — estimate it then.
    pub fn uncachedTokens(c: *const ScoreCtx, i: usize) ?i64 {
        if (i >= c.uncached_tokens.len or c.uncached_tokens[i] < 0) return null;
        return c.uncached_tokens[i];
    }

    /// The smallest `work` over the candidates (0 when there are none).
    pub fn minWork(c: *const ScoreCtx) i64 {
        var best: i64 = std.math.maxInt(i64);
        for (0..c.candidates.len) |i| best = @min(best, c.work(i));
        return if (c.candidates.len == 0) 0 else best;
    }
};

/// How strings are kept by a decode: aliased into the input or copied into `arena`.
pub const Strings = struct {
    arena: Allocator,
    copy: bool,

    fn str(s: Strings, r: *Reader, comptime what: []const u8) Error![]const u8 {
        const v = try r.str(what);
        return if (s.copy) try s.arena.dupe(u8, v) else v;
    }
};

fn strList(r: *Reader, s: Strings, comptime what: []const u8) Error![]const []const u8 {
    const n = try r.arrayLen(what);
    const out = try s.arena.alloc([]const u8, n);
    for (out) |*v| v.* = try s.str(r, what ++ "[]");
    return out;
}

/// Decode an `EndpointMetrics`.
pub fn decodeEndpoint(r: *Reader, s: Strings) Error!Endpoint {
    const n = try r.arrayLen("snapshot.endpoints[]");
    if (n < 1) return report.fail("snapshot.endpoints[] has no address (an empty array at byte {d})", .{r.pos});
    var e: Endpoint = .{};
    e.address = try s.str(r, "snapshot.endpoints[].address");
    if (n > 1) e.waiting = try r.int("snapshot.endpoints[].waiting");
    if (n > 2) e.running = try r.int("snapshot.endpoints[].running");
    if (n > 3) e.kv_usage = try r.float("snapshot.endpoints[].kv_usage");
    if (n > 4) e.running_adapters = try strList(r, s, "snapshot.endpoints[].running_adapters");
    if (n > 5) e.waiting_adapters = try strList(r, s, "snapshot.endpoints[].waiting_adapters");
    if (n > 6) e.max_lora = try r.int("snapshot.endpoints[].max_lora");
    if (n > 7) e.num_gpu_blocks = try r.int("snapshot.endpoints[].num_gpu_blocks");
    if (n > 8) e.block_size = try r.int("snapshot.endpoints[].block_size");
    if (n > 9) e.deferred = try r.int("snapshot.endpoints[].deferred");
    if (n > 10) try r.skipN("snapshot.endpoints[] (trailing)", n - 10);
    return e;
}

/// Decode a `Snapshot`.
pub fn decodeSnapshot(r: *Reader, s: Strings) Error!Snapshot {
    const n = try r.arrayLen("snapshot");
    var snap: Snapshot = .{};
    if (n > 0) snap.schema = try r.int("snapshot.schema");
    if (snap.schema != 1) return report.fail("snapshot.schema is {d}; this policy reads schema 1", .{snap.schema});
    if (n > 1) snap.version = try r.int("snapshot.version");
    if (n > 2) snap.timestamp_ms = try r.int("snapshot.timestamp_ms");
    if (n > 3) {
        const m = try r.arrayLen("snapshot.endpoints");
        const eps = try s.arena.alloc(Endpoint, m);
        for (eps) |*e| e.* = try decodeEndpoint(r, s);
        snap.endpoints = eps;
    }
    if (n > 4) try r.skipN("snapshot (trailing)", n - 4);
    return snap;
}

/// Decode a `Request` (`what` names where it sits, for messages).
pub fn decodeRequest(r: *Reader, s: Strings, comptime what: []const u8) Error!Request {
    const n = try r.arrayLen(what);
    var q: Request = .{};
    if (n > 0) q.request_id = try s.str(r, what ++ ".request_id");
    if (n > 1) q.model = try s.str(r, what ++ ".model");
    if (n > 2) q.adapter = try s.str(r, what ++ ".adapter");
    if (n > 3) q.prompt = try s.str(r, what ++ ".prompt");
    if (n > 4) q.criticality = try r.int(what ++ ".criticality");
    if (n > 5) q.seed = try r.uint64(what ++ ".seed");
    if (n > 6) q.cache_salt = try s.str(r, what ++ ".cache_salt");
    if (n > 7) {
        const m = try r.mapLen(what ++ ".headers");
        const hs = try s.arena.alloc(Header, m);
        for (hs) |*h| {
            h.name = try s.str(r, what ++ ".headers key");
            h.value = try s.str(r, what ++ ".headers value");
        }
        q.headers = hs;
    }
    if (n > 8) q.slo_ttft_ms = try r.int(what ++ ".slo_ttft_ms");
    if (n > 9) q.slo_tpot_ms = try r.int(what ++ ".slo_tpot_ms");
    if (n > 10) q.prompt_tokens = try r.int(what ++ ".prompt_tokens");
    if (n > 11) q.session_id = try s.str(r, what ++ ".session_id");
    if (n > 12) try r.skipN(what ++ " (trailing)", n - 12);
    return q;
}

/// The undecoded parts of a `ScoreInput`: the snapshot (nil or not) is decoded by the
/// caller, who knows whether one is resident.
pub const ScoreInputHead = struct { elements: u32, snapshot_nil: bool };

pub fn decodeScoreInputHead(r: *Reader) Error!ScoreInputHead {
    const n = try r.arrayLen("ScoreInput");
    if (n < 3) return report.fail("ScoreInput has {d} elements; needs [snapshot, request, candidates]", .{n});
    return .{ .elements = n, .snapshot_nil = r.nil() };
}

/// After the snapshot: the request and the candidates (checked against `endpoints`).
pub fn decodeScoreInputTail(r: *Reader, s: Strings, head: ScoreInputHead, snap: *const Snapshot) Error!ScoreCtx {
    const q = try decodeRequest(r, s, "request");
    const m = try r.arrayLen("candidates");
    const cands = try s.arena.alloc(u32, m);
    for (cands, 0..) |*c, i| {
        const v = try r.int("candidates[]");
        if (v < 0 or v >= snap.endpoints.len) {
            return report.fail("candidates[{d}] = {d} is out of range for a snapshot of {d} endpoints", .{ i, v, snap.endpoints.len });
        }
        c.* = @intCast(v);
    }
    var in_flight: []const i64 = &.{};
    var since: []const i64 = &.{};
    if (head.elements > 3) in_flight = try perCandidate(r, s, "in_flight", m);
    if (head.elements > 4) since = try perCandidate(r, s, "picked_since_scrape", m);
    var blocks: []const i64 = &.{};
    var matched: []const i64 = &.{};
    if (head.elements > 5) blocks = try perCandidate(r, s, "prefix_blocks", m);
    if (head.elements > 6) matched = try perCandidate(r, s, "prefix_matched", m);
    var cleared: []const i64 = &.{};
    if (head.elements > 7) cleared = try perCandidate(r, s, "prefix_cleared_ms", m);
    var uncached: []const i64 = &.{};
    if (head.elements > 8) uncached = try perCandidate(r, s, "uncached_tokens", m);
    if (head.elements > 9) try r.skipN("ScoreInput (trailing)", head.elements - 9);
    return .{
        .snapshot = snap, .request = q, .candidates = cands, .in_flight = in_flight,
        .picked_since_scrape = since, .prefix_blocks = blocks, .prefix_matched = matched,
        .prefix_cleared_ms = cleared, .uncached_tokens = uncached,
    };
}

/// An array parallel to the candidates, or empty.
fn perCandidate(r: *Reader, s: Strings, comptime what: []const u8, n: u32) Error![]const i64 {
    const m = try r.arrayLen(what);
    if (m == 0) return &.{};
    if (m != n) return report.fail(what ++ " has {d} values for {d} candidates", .{ m, n });
    const out = try s.arena.alloc(i64, m);
    for (out) |*v| v.* = try r.int(what ++ "[]");
    return out;
}

pub fn decodePreRequest(r: *Reader, s: Strings) Error!PreRequest {
    const n = try r.arrayLen("PreRequestEvent");
    var ev: PreRequest = .{};
    if (n > 0) ev.request = try decodeRequest(r, s, "PreRequestEvent.request");
    if (n > 1) ev.endpoint = try s.str(r, "PreRequestEvent.endpoint");
    if (n > 2) ev.timestamp_ms = try r.int("PreRequestEvent.timestamp_ms");
    if (n > 3) try r.skipN("PreRequestEvent (trailing)", n - 3);
    return ev;
}

pub fn decodePostResponse(r: *Reader, s: Strings) Error!PostResponse {
    const n = try r.arrayLen("PostResponseEvent");
    var ev: PostResponse = .{};
    if (n > 0) ev.request_id = try s.str(r, "PostResponseEvent.request_id");
    if (n > 1) ev.adapter = try s.str(r, "PostResponseEvent.adapter");
    if (n > 2) ev.endpoint = try s.str(r, "PostResponseEvent.endpoint");
    if (n > 3) ev.status = try r.int("PostResponseEvent.status");
    if (n > 4) ev.timestamp_ms = try r.int("PostResponseEvent.timestamp_ms");
    if (n > 5) ev.model = try s.str(r, "PostResponseEvent.model");
    if (n > 6) ev.ttft_ms = try r.float("PostResponseEvent.ttft_ms");
    if (n > 7) ev.prompt_tokens = try r.int("PostResponseEvent.prompt_tokens");
    if (n > 8) ev.completion_tokens = try r.int("PostResponseEvent.completion_tokens");
    if (n > 9) try r.skipN("PostResponseEvent (trailing)", n - 9);
    return ev;
}

/// After a whole payload: anything left over is an error (a second value, or garbage).
pub fn expectEnd(r: *const Reader, comptime what: []const u8) Error!void {
    if (!r.atEnd()) return report.fail("{d} unexpected bytes after the " ++ what ++ " at byte {d}", .{ r.buf.len - r.pos, r.pos });
}

// -- ABI v2: the score frame (policies/ABI.md, "The score frame") ------------------------

/// The header's u32 words (host/abi.py FRAME_HEADER).
pub const frame_header_words = 8;
pub const frame_header_bytes = 4 * frame_header_words;
/// The per-candidate i64 arrays this SDK knows, in frame order (host/abi.py FRAME_ARRAYS);
/// arrays a newer host appends are skipped.
pub const frame_arrays = [_][]const u8{
    "in_flight", "picked_since_scrape", "prefix_blocks", "prefix_matched", "prefix_cleared_ms", "uncached_tokens",
};
/// Status of a v2 `score`/`filter` whose carried pre_request event failed (nothing scored).
pub const frame_event_failed: i32 = 2;

/// A score frame, read in place: nothing is copied or allocated.
pub const Frame = struct {
    candidates: []const u32,
    values: [frame_arrays.len][]const i64 = @splat(&.{}),
    /// The msgpack Request.
    request: []const u8,
    /// The msgpack Snapshot; empty = the resident one.
    snapshot: []const u8,
    /// A msgpack PreRequestEvent to apply before scoring; empty = none.
    event: []const u8,
};

fn word(bytes: []const u8, i: usize) u32 {
    return std.mem.readInt(u32, bytes[4 * i ..][0..4], .little);
}

/// Read a frame's header and find its parts; every length is checked against the input.
pub fn parseFrame(bytes: []const u8) Error!Frame {
    if (bytes.len < frame_header_bytes) return report.fail("score frame: {d} bytes, shorter than its {d}-byte header", .{ bytes.len, frame_header_bytes });
    if (@intFromPtr(bytes.ptr) % 8 != 0) return report.fail("score frame: not 8-byte aligned", .{});
    const n: u64 = word(bytes, 0);
    const arrays: u64 = word(bytes, 1);
    const present = word(bytes, 2);
    if (arrays > 32) return report.fail("score frame: {d} per-candidate arrays (at most 32)", .{arrays});
    if (arrays < 32 and (present >> @intCast(arrays)) != 0) return report.fail("score frame: present bits 0x{x} beyond its {d} arrays", .{ present, arrays });
    var at: u64 = frame_header_bytes;
    const cand_bytes = (4 * n + 7) & ~@as(u64, 7);
    if (cand_bytes > bytes.len - at) return report.fail("score frame: {d} candidates do not fit in {d} bytes", .{ n, bytes.len });
    var f: Frame = .{
        .candidates = @as([*]const u32, @ptrCast(@alignCast(bytes.ptr + @as(usize, @intCast(at)))))[0..@intCast(n)],
        .request = &.{},
        .snapshot = &.{},
        .event = &.{},
    };
    at += cand_bytes;
    var k: u6 = 0;
    while (k < arrays) : (k += 1) {
        if ((present >> @intCast(k)) & 1 == 0) continue;
        if (8 * n > bytes.len - at) return report.fail("score frame: array {d} does not fit in {d} bytes", .{ k, bytes.len });
        if (k < frame_arrays.len) f.values[k] = @as([*]const i64, @ptrCast(@alignCast(bytes.ptr + @as(usize, @intCast(at)))))[0..@intCast(n)];
        at += 8 * n;
    }
    var parts: [5][]const u8 = undefined;
    for (&parts, 0..) |*p, i| {
        const size: u64 = word(bytes, 3 + i);
        if (size > bytes.len - at) return report.fail("score frame: section {d} ({d} bytes) does not fit in {d} bytes", .{ i, size, bytes.len });
        p.* = bytes[@intCast(at)..@intCast(at + size)];
        at += size;
    }
    if (at != bytes.len) return report.fail("score frame: {d} unexpected bytes after its sections", .{bytes.len - at});
    f.request = parts[0];
    f.snapshot = parts[1];
    f.event = parts[2];
    return f;
}

/// The `ScoreCtx` of a frame: its arrays are read in place; the request is decoded
/// (strings alias the frame); the candidates are checked against `snap`.
pub fn frameCtx(f: *const Frame, s: Strings, snap: *const Snapshot) Error!ScoreCtx {
    var r = Reader.init(f.request);
    const q = try decodeRequest(&r, s, "request");
    try expectEnd(&r, "request");
    for (f.candidates, 0..) |c, i| {
        if (c >= snap.endpoints.len) {
            return report.fail("candidates[{d}] = {d} is out of range for a snapshot of {d} endpoints", .{ i, c, snap.endpoints.len });
        }
    }
    return .{
        .snapshot = snap, .request = q, .candidates = f.candidates,
        .in_flight = f.values[0], .picked_since_scrape = f.values[1], .prefix_blocks = f.values[2],
        .prefix_matched = f.values[3], .prefix_cleared_ms = f.values[4], .uncached_tokens = f.values[5],
    };
}
