//! The epick policy SDK for Zig: a policy is a struct of hooks, the SDK is the ABI.
//!
//! ```zig
//! const sdk = @import("epick");
//! pub const name = "least-kv";
//! pub const version = "1.0.0";
//! pub const kind = "custom";
//! pub const Params = struct { floor: f64 = 0 };
//! pub fn score(ctx: *const sdk.ScoreCtx, out: []f64) sdk.Error!void { ... }
//! comptime { sdk.exportPolicy(@This()); }
//! ```
//!
//! Hooks a policy may declare (all optional except one of `score`/`filter`):
//!   `Params` (struct, see params.zig)        `init(p: *const Params) Error!void`
//!   `score(ctx, out: []f64) Error!void`      `filter(ctx, keep: []u8) Error!void`
//!   `onSnapshot(snap: *const Snapshot) Error!void` — a new pool view (resident or inline)
//!   `preRequest(ev: *const PreRequest) Error!void`
//!   `postResponse(ev: *const PostResponse) Error!void`
//!   `exportState(w: *Writer) Error!void`     `importState(r: *Reader) Error!void`
//!   `resident_snapshot: bool` (default true: export `set_snapshot`)
//!
//! Memory (policies/README.md, "Memory"): `alloc` hands the host buffers from `gpa` that
//! are never freed or reused; `scratch` is an arena reset before every call; the resident
//! snapshot lives in its own arena, replaced per `set_snapshot`; policy state uses `gpa`
//! and must be freed by the policy (its `init` resets everything). Hook inputs alias the
//! host's buffers: copy what you keep.
//!
//! Errors: return `sdk.fail("message naming {s}", .{what})`; the SDK turns it into a
//! non-zero status and the message `error_ptr`/`error_len` expose. Nothing traps on bad
//! input.
//!
//! Panics: the root file declares `pub const panic = sdk.panic;` (Zig looks for the panic
//! handler in the root file only; `exportPolicy` refuses to build without it). A
//! `@panic("msg")` then still traps, but leaves `panic: msg` where errors go, and the
//! host quotes it beside the trap.
//!
//! Hooks are found by name, so `exportPolicy` refuses what looks like a misspelt hook (it
//! would never be called): a `pub` declaration spelt like one but for case and `_`
//! (`pre_request`, `PreRequest`), a long hook name with a typo or two (`preRequst`), and a
//! `pub fn` within two edits of a hook the policy lacks that takes that hook's parameters
//! (`scroe(ctx: *const ScoreCtx, out: []f64)`, `inti(p: *const Params)`). It also refuses
//! `Params` without `init` (the params would be read and never applied), and a policy with
//! neither `score` nor `filter`, naming the declarations close to those names.

const std = @import("std");

pub const msgpack = @import("msgpack.zig");
pub const abi = @import("abi.zig");
pub const params = @import("params.zig");
pub const report = @import("report.zig");
/// The approximate prefix-cache estimate (prefix-cache, precise-prefix's fallback).
pub const prefix = @import("prefix.zig");

pub const Error = report.Error;
pub const fail = report.fail;
pub const Reader = msgpack.Reader;
pub const Writer = msgpack.Writer;
pub const Snapshot = abi.Snapshot;
pub const Endpoint = abi.Endpoint;
pub const Request = abi.Request;
pub const ScoreCtx = abi.ScoreCtx;
pub const PreRequest = abi.PreRequest;
pub const PostResponse = abi.PostResponse;
pub const Criticality = abi.Criticality;
pub const contains = abi.contains;

/// The ABI version this SDK implements (policies/ABI.md): score frames, read in place,
/// and pre_request events carried by the next score/filter call.
pub const abi_version: i32 = 2;

/// The general-purpose allocator over the module's linear memory (grows it on demand).
pub const gpa: std.mem.Allocator = std.heap.wasm_allocator;

var scratch_arena = std.heap.ArenaAllocator.init(gpa);
/// An arena reset at the start of every exported call: per-call temporaries.
pub fn scratch() std.mem.Allocator {
    return scratch_arena.allocator();
}

/// Bytes the scratch arena holds from `init` on.
const scratch_preheat = 64 * 1024;

var output: std.ArrayList(u8) = .empty;

/// SplitMix64 (Steele, Lea & Flood 2014): the SDK's deterministic random stream, seeded
/// by `Request.seed` — the only randomness a policy may use.
pub const SplitMix64 = struct {
    state: u64,

    pub fn init(seed: u64) SplitMix64 {
        return .{ .state = seed };
    }

    pub fn next(s: *SplitMix64) u64 {
        s.state +%= 0x9e3779b97f4a7c15;
        var z = s.state;
        z = (z ^ (z >> 30)) *% 0xbf58476d1ce4e5b9;
        z = (z ^ (z >> 27)) *% 0x94d049bb133111eb;
        return z ^ (z >> 31);
    }

    /// A float in [0, 1) from the top 53 bits.
    pub fn float(s: *SplitMix64) f64 {
        return @as(f64, @floatFromInt(s.next() >> 11)) * 0x1.0p-53;
    }

    /// An integer in [0, n) (n > 0), unbiased (Lemire's rejection on the high product).
    pub fn below(s: *SplitMix64, n: u64) u64 {
        var m: u128 = @as(u128, s.next()) * n;
        var low: u64 = @truncate(m);
        if (low < n) {
            const threshold = (0 -% n) % n;
            while (low < threshold) {
                m = @as(u128, s.next()) * n;
                low = @truncate(m);
            }
        }
        return @intCast(m >> 64);
    }
};

fn bytesAt(ptr: usize, len: usize) []const u8 {
    if (len == 0) return &.{};
    return @as([*]const u8, @ptrFromInt(ptr))[0..len];
}

/// The panic handler every policy's root file installs: `pub const panic = sdk.panic;`.
pub const panic = std.debug.FullPanic(panicHandler);

fn panicHandler(msg: []const u8, _: ?usize) noreturn {
    @branchHint(.cold);
    report.panicked(msg);
    @trap();
}

/// The declarations the SDK reads from a policy (hooks first).
const known_decls = [_][]const u8{
    "init",        "score",       "filter", "onSnapshot", "preRequest", "postResponse",
    "exportState", "importState", "Params", "name",       "version",    "kind",
    "resident_snapshot", "panic",
};
const hook_list = "init, score, filter, onSnapshot, preRequest, postResponse, exportState, importState, resident_snapshot";

/// `name` lower-cased without underscores: `pre_request` and `PreRequest` become `prerequest`.
fn folded(comptime name: []const u8) []const u8 {
    comptime {
        var out: [name.len]u8 = undefined;
        var n: usize = 0;
        for (name) |c| {
            if (c == '_') continue;
            out[n] = std.ascii.toLower(c);
            n += 1;
        }
        const final = out[0..n].*;
        return &final;
    }
}

/// Edit distance counting a swap of two neighbours as one edit (`scroe` is 1 from
/// `score`), for names of a few dozen bytes at comptime.
fn distance(comptime a: []const u8, comptime b: []const u8) usize {
    comptime {
        var d: [a.len + 1][b.len + 1]usize = undefined;
        for (0..a.len + 1) |i| d[i][0] = i;
        for (0..b.len + 1) |j| d[0][j] = j;
        for (1..a.len + 1) |i| {
            for (1..b.len + 1) |j| {
                const cost: usize = if (a[i - 1] == b[j - 1]) 0 else 1;
                d[i][j] = @min(@min(d[i - 1][j] + 1, d[i][j - 1] + 1), d[i - 1][j - 1] + cost);
                if (i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]) {
                    d[i][j] = @min(d[i][j], d[i - 2][j - 2] + 1);
                }
            }
        }
        return d[a.len][b.len];
    }
}

/// How far a `pub fn` name may be from a hook's (case and `_` ignored) and still be
/// taken for that hook, misspelt.
const near = 2;

/// The hook `decl` is within `near` edits of, among `hooks`, or null.
fn nearHook(comptime decl: []const u8, comptime hooks: []const []const u8) ?[]const u8 {
    comptime {
        for (hooks) |h| {
            if (std.mem.eql(u8, decl, h)) return null;
        }
        for (hooks) |h| {
            if (distance(folded(decl), folded(h)) <= near) return h;
        }
        return null;
    }
}

/// The parameter types the SDK calls hook `hook` with (null: not a function hook).
fn hookParams(comptime P: type, comptime hook: []const u8) ?[]const type {
    const Params = if (@hasDecl(P, "Params")) P.Params else struct {};
    const eql = std.mem.eql;
    if (eql(u8, hook, "init")) return &.{*const Params};
    if (eql(u8, hook, "score")) return &.{ *const ScoreCtx, []f64 };
    if (eql(u8, hook, "filter")) return &.{ *const ScoreCtx, []u8 };
    if (eql(u8, hook, "onSnapshot")) return &.{*const Snapshot};
    if (eql(u8, hook, "preRequest")) return &.{*const PreRequest};
    if (eql(u8, hook, "postResponse")) return &.{*const PostResponse};
    if (eql(u8, hook, "exportState")) return &.{*Writer};
    if (eql(u8, hook, "importState")) return &.{*Reader};
    return null;
}

/// `F` is a function type taking exactly the parameter types `want`.
fn takes(comptime F: type, comptime want: []const type) bool {
    comptime {
        const info = @typeInfo(F);
        if (info != .@"fn") return false;
        const got = info.@"fn".param_types;
        if (got.len != want.len) return false;
        for (got, want) |g, w| {
            if ((g orelse return false) != w) return false;
        }
        return true;
    }
}

const fn_hooks = [_][]const u8{
    "init", "score", "filter", "onSnapshot", "preRequest", "postResponse", "exportState", "importState",
};

/// A `pub fn` that is a hook misspelt: within `near` edits of a hook the policy does not
/// declare, taking that hook's parameters (`pub fn scroe(ctx: *const sdk.ScoreCtx, out:
/// []f64)`). A helper of another shape (`pub fn store() void`) is the author's own.
fn misspeltHook(comptime P: type, comptime decl: []const u8) ?[]const u8 {
    comptime {
        const h = nearHook(decl, &fn_hooks) orelse return null;
        if (@hasDecl(P, h)) return null;
        const F = @TypeOf(@field(P, decl));
        return if (takes(F, hookParams(P, h).?)) h else null;
    }
}

/// "; `pub scroe` is not `score`" for every declaration of `P` near one of `hooks`.
fn nearNames(comptime P: type, comptime hooks: []const []const u8) []const u8 {
    comptime {
        var out: []const u8 = "";
        for (std.meta.declarations(P)) |decl| {
            if (nearHook(decl, hooks)) |h| {
                out = out ++ "; `pub " ++ decl ++ "` is not `" ++ h ++ "`: did you mean `" ++ h ++ "`?";
            }
        }
        return out;
    }
}

/// The SDK name `decl` most likely meant, or null: same letters ignoring case and `_`,
/// or (for the long hook names, where a clash with a helper is unlikely) a typo or two.
fn meant(comptime decl: []const u8) ?[]const u8 {
    comptime {
        for (known_decls) |k| {
            if (std.mem.eql(u8, decl, k)) return null;
        }
        for (known_decls) |k| {
            const fk = folded(k);
            const fd = folded(decl);
            if (std.mem.eql(u8, fd, fk)) return k;
            if (fk.len >= 10 and distance(fd, fk) <= 2) return k;
        }
        return null;
    }
}

fn checkDecls(comptime P: type) void {
    comptime {
        @setEvalBranchQuota(200_000);
        for (std.meta.declarations(P)) |decl| {
            const k: ?[]const u8 = meant(decl) orelse misspeltHook(P, decl);
            if (k) |hook| {
                @compileError("policy '" ++ P.name ++ "' declares `pub " ++ decl ++ "`, which the SDK never calls: did you mean `" ++ hook ++ "`? (hooks: " ++ hook_list ++ ")");
            }
        }
        if (@hasDecl(P, "Params") and !@hasDecl(P, "init")) {
            @compileError("policy '" ++ P.name ++ "' declares `Params` but no `init`, so its params would be read and never applied: add `pub fn init(p: *const Params) sdk.Error!void`" ++ nearNames(P, &.{"init"}));
        }
        if (!@hasDecl(P, "score") and !@hasDecl(P, "filter")) {
            @compileError("policy '" ++ P.name ++ "' declares neither `score` nor `filter`; a policy declares one (or both)" ++ nearNames(P, &.{ "score", "filter" }));
        }
        if (!@hasDecl(P, "panic")) {
            @compileError("policy '" ++ P.name ++ "': add `pub const panic = sdk.panic;` to its root file, so that a @panic's message reaches the host (Zig looks for the panic handler in the root file only)");
        }
    }
}

/// Export the ABI for policy `P` (call it from a `comptime` block in the policy's root).
pub fn exportPolicy(comptime P: type) void {
    checkDecls(P);
    const E = Exports(P);
    @export(&E.epick_abi_version, .{ .name = "epick_abi_version" });
    @export(&E.alloc, .{ .name = "alloc" });
    @export(&E.error_ptr, .{ .name = "error_ptr" });
    @export(&E.error_len, .{ .name = "error_len" });
    @export(&E.output_ptr, .{ .name = "output_ptr" });
    @export(&E.output_len, .{ .name = "output_len" });
    @export(&E.init, .{ .name = "init" });
    @export(&E.describe, .{ .name = "describe" });
    if (@hasDecl(P, "score")) @export(&E.score, .{ .name = "score" });
    if (@hasDecl(P, "filter")) @export(&E.filter, .{ .name = "filter" });
    if (E.resident) @export(&E.set_snapshot, .{ .name = "set_snapshot" });
    if (@hasDecl(P, "preRequest")) @export(&E.pre_request, .{ .name = "pre_request" });
    if (@hasDecl(P, "postResponse")) @export(&E.post_response, .{ .name = "post_response" });
    if (@hasDecl(P, "exportState")) @export(&E.export_state, .{ .name = "export_state" });
    if (@hasDecl(P, "importState")) @export(&E.import_state, .{ .name = "import_state" });
}

fn Exports(comptime P: type) type {
    return struct {
        const Params = if (@hasDecl(P, "Params")) P.Params else struct {};
        const resident = if (@hasDecl(P, "resident_snapshot")) P.resident_snapshot else true;
        const kind: []const u8 = if (@hasDecl(P, "kind")) P.kind else "custom";
        const version: []const u8 = if (@hasDecl(P, "version")) P.version else "0.0.0";

        /// Params outlive calls: strings in them are copied here, reset per `init`.
        var params_arena = std.heap.ArenaAllocator.init(gpa);
        var current: Params = .{};
        var initialised = false;

        // The resident snapshot, double-buffered so `onSnapshot` sees the new one while
        // the old one is still valid.
        var snap_arenas = [2]std.heap.ArenaAllocator{ .init(gpa), .init(gpa) };
        var snaps = [2]abi.Snapshot{ .{}, .{} };
        var snap_live: usize = 0;
        var have_snapshot = false;
        // The version `onSnapshot` last saw, to notice a new inline snapshot.
        var seen_version: ?i64 = null;

        fn begin() void {
            _ = scratch_arena.reset(.retain_capacity);
            report.clear();
        }

        fn guard(result: Error!void) i32 {
            if (result) |_| return 0 else |err| return report.status(err);
        }

        fn epick_abi_version() callconv(.c) i32 {
            return abi_version;
        }

        fn alloc(len: usize) callconv(.c) usize {
            const buf = gpa.alignedAlloc(u8, .@"16", @max(len, 1)) catch return 0;
            return @intFromPtr(buf.ptr);
        }

        fn error_ptr() callconv(.c) usize {
            return report.ptr();
        }

        fn error_len() callconv(.c) usize {
            return report.length();
        }

        fn output_ptr() callconv(.c) usize {
            return @intFromPtr(output.items.ptr);
        }

        fn output_len() callconv(.c) usize {
            return output.items.len;
        }

        fn doInit(bytes: []const u8) Error!void {
            initialised = false;
            // Pre-heat the scratch arena: ordinary calls then never reach the allocator
            // underneath, and memory use settles at init rather than mid-traffic.
            _ = scratch().alloc(u8, scratch_preheat) catch {};
            _ = scratch_arena.reset(.retain_capacity);
            _ = params_arena.reset(.free_all);
            have_snapshot = false;
            seen_version = null;
            for (&snap_arenas) |*a| _ = a.reset(.free_all);
            current = try params.decode(Params, bytes, params_arena.allocator());
            if (@hasDecl(P, "init")) try P.init(&current);
            initialised = true;
        }

        fn init(ptr: usize, len: usize) callconv(.c) i32 {
            begin();
            return guard(doInit(bytesAt(ptr, len)));
        }

        fn needInit() Error!void {
            if (!initialised) return report.fail("init has not succeeded yet (call init with the params first)", .{});
        }

        fn noticeSnapshot(snap: *const abi.Snapshot, always: bool) Error!void {
            if (!always) {
                if (seen_version) |v| if (v == snap.version) return;
            }
            if (@hasDecl(P, "onSnapshot")) try P.onSnapshot(snap);
            seen_version = snap.version;
        }

        fn doSetSnapshot(bytes: []const u8) Error!void {
            try needInit();
            const next = 1 - snap_live;
            _ = snap_arenas[next].reset(.retain_capacity);
            var r = Reader.init(bytes);
            const snap = try abi.decodeSnapshot(&r, .{ .arena = snap_arenas[next].allocator(), .copy = true });
            try abi.expectEnd(&r, "snapshot");
            snaps[next] = snap;
            try noticeSnapshot(&snaps[next], true);
            snap_live = next;
            have_snapshot = true;
        }

        fn set_snapshot(ptr: usize, len: usize) callconv(.c) i32 {
            begin();
            return guard(doSetSnapshot(bytesAt(ptr, len)));
        }

        /// The ScoreCtx of a score frame (ABI v2), its arrays read in place.
        fn frameCtx(f: *const abi.Frame) Error!abi.ScoreCtx {
            try needInit();
            const strings: abi.Strings = .{ .arena = scratch(), .copy = false };
            var snap: *const abi.Snapshot = undefined;
            if (f.snapshot.len == 0) {
                if (!have_snapshot) return report.fail("the score frame has no snapshot but none was set (call set_snapshot first)", .{});
                snap = &snaps[snap_live];
            } else {
                var r = Reader.init(f.snapshot);
                const s = try scratch().create(abi.Snapshot);
                s.* = try abi.decodeSnapshot(&r, strings);
                try abi.expectEnd(&r, "snapshot");
                try noticeSnapshot(s, false);
                snap = s;
            }
            var ctx = try abi.frameCtx(f, strings, snap);
            ctx.resident = f.snapshot.len == 0;
            return ctx;
        }

        /// Read the frame and apply the pre_request event it carries, if any: its failure
        /// is the call's status `frame_event_failed`, nothing scored (the host reports it
        /// as pre_request's and calls again without it).
        fn openFrame(bytes: []const u8, status: *i32) ?abi.Frame {
            const f = abi.parseFrame(bytes) catch |err| {
                status.* = report.status(err);
                return null;
            };
            if (f.event.len > 0) {
                const result: Error!void = if (@hasDecl(P, "preRequest"))
                    doPreRequest(f.event)
                else
                    report.fail("the score frame carries a pre_request event, but this policy has no preRequest", .{});
                if (result) |_| {} else |err| {
                    _ = report.status(err);
                    status.* = abi.frame_event_failed;
                    return null;
                }
                begin(); // the scoring starts with a clean scratch arena and message
            }
            return f;
        }

        fn doScore(f: *const abi.Frame, out_ptr: usize) Error!void {
            const ctx = try frameCtx(f);
            const out = try scratch().alloc(f64, ctx.candidates.len);
            try P.score(&ctx, out);
            // The host's buffer need not be 8-aligned: copy bytes.
            if (out.len > 0) @memcpy(@as([*]u8, @ptrFromInt(out_ptr))[0 .. out.len * 8], std.mem.sliceAsBytes(out));
        }

        fn score(ptr: usize, len: usize, out_ptr: usize) callconv(.c) i32 {
            begin();
            var status: i32 = 0;
            const f = openFrame(bytesAt(ptr, len), &status) orelse return status;
            return guard(doScore(&f, out_ptr));
        }

        fn doFilter(f: *const abi.Frame, out_ptr: usize) Error!void {
            const ctx = try frameCtx(f);
            const keep = try scratch().alloc(u8, ctx.candidates.len);
            @memset(keep, 1);
            try P.filter(&ctx, keep);
            if (keep.len > 0) @memcpy(@as([*]u8, @ptrFromInt(out_ptr))[0..keep.len], keep);
        }

        fn filter(ptr: usize, len: usize, out_ptr: usize) callconv(.c) i32 {
            begin();
            var status: i32 = 0;
            const f = openFrame(bytesAt(ptr, len), &status) orelse return status;
            return guard(doFilter(&f, out_ptr));
        }

        fn doPreRequest(bytes: []const u8) Error!void {
            try needInit();
            var r = Reader.init(bytes);
            const ev = try abi.decodePreRequest(&r, .{ .arena = scratch(), .copy = false });
            try abi.expectEnd(&r, "PreRequestEvent");
            try P.preRequest(&ev);
        }

        fn pre_request(ptr: usize, len: usize) callconv(.c) i32 {
            begin();
            return guard(doPreRequest(bytesAt(ptr, len)));
        }

        fn doPostResponse(bytes: []const u8) Error!void {
            try needInit();
            var r = Reader.init(bytes);
            const ev = try abi.decodePostResponse(&r, .{ .arena = scratch(), .copy = false });
            try abi.expectEnd(&r, "PostResponseEvent");
            try P.postResponse(&ev);
        }

        fn post_response(ptr: usize, len: usize) callconv(.c) i32 {
            begin();
            return guard(doPostResponse(bytesAt(ptr, len)));
        }

        fn doDescribe() Error!void {
            output.clearRetainingCapacity();
            var w: Writer = .{ .list = &output, .gpa = gpa };
            try w.mapHeader(4);
            try w.str("name");
            try w.str(P.name);
            try w.str("version");
            try w.str(version);
            try w.str("kind");
            try w.str(kind);
            try w.str("params");
            const defaults: Params = .{};
            try params.write(Params, &defaults, &w);
        }

        fn describe() callconv(.c) i32 {
            begin();
            return guard(doDescribe());
        }

        fn doExportState() Error!void {
            try needInit();
            output.clearRetainingCapacity();
            var w: Writer = .{ .list = &output, .gpa = gpa };
            try P.exportState(&w);
        }

        fn export_state() callconv(.c) i32 {
            begin();
            return guard(doExportState());
        }

        fn doImportState(bytes: []const u8) Error!void {
            try needInit();
            var r = Reader.init(bytes);
            P.importState(&r) catch |err| {
                // ABI: a failed import leaves the policy freshly initialised. Keep the
                // import's message, not the re-init's.
                const saved_len = report.length();
                var saved: [1024]u8 = undefined;
                @memcpy(saved[0..saved_len], @as([*]const u8, @ptrFromInt(report.ptr()))[0..saved_len]);
                if (@hasDecl(P, "init")) P.init(&current) catch {};
                return restore(saved[0..saved_len], err);
            };
            if (!r.atEnd()) {
                if (@hasDecl(P, "init")) P.init(&current) catch {};
                return report.fail("{d} unexpected bytes after the state at byte {d}", .{ r.buf.len - r.pos, r.pos });
            }
        }

        fn restore(msg: []const u8, err: Error) Error {
            if (err == error.OutOfMemory) return err;
            return report.fail("{s}", .{msg});
        }

        fn import_state(ptr: usize, len: usize) callconv(.c) i32 {
            begin();
            return guard(doImportState(bytesAt(ptr, len)));
        }
    };
}
