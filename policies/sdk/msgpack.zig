//! msgpack reading and writing for the epick ABI — just the subset the ABI uses.
//!
//! `Reader` never traps on bad input: every read checks the bytes left and the type tag
//! and, on a mismatch, records a message naming *what* was being read (a comptime label
//! such as "request.model") and the byte offset, then returns `error.Invalid`.
//! `Writer` appends to a growable buffer (the SDK's output region).

const std = @import("std");
const report = @import("report.zig");

pub const Error = report.Error;

/// Values nested deeper than this are refused instead of walked (skip is iterative, but a
/// bound keeps garbage from looking like a huge document).
const max_skip_values: u64 = 1 << 24;

pub const Reader = struct {
    buf: []const u8,
    pos: usize = 0,

    pub fn init(buf: []const u8) Reader {
        return .{ .buf = buf };
    }

    pub fn atEnd(r: *const Reader) bool {
        return r.pos >= r.buf.len;
    }

    fn typeName(tag: u8) []const u8 {
        return switch (tag) {
            0x00...0x7f, 0xe0...0xff, 0xcc...0xd3 => "int",
            0x80...0x8f, 0xde, 0xdf => "map",
            0x90...0x9f, 0xdc, 0xdd => "array",
            0xa0...0xbf, 0xd9...0xdb => "str",
            0xc0 => "nil",
            0xc2, 0xc3 => "bool",
            0xc4...0xc6 => "bin",
            0xca, 0xcb => "float",
            0xc7...0xc9, 0xd4...0xd8 => "ext",
            0xc1 => "invalid byte 0xc1",
        };
    }

    fn truncated(r: *const Reader, what: []const u8) Error {
        return report.fail("truncated input reading {s} at byte {d} of {d}", .{ what, r.pos, r.buf.len });
    }

    fn mismatch(r: *const Reader, what: []const u8, expected: []const u8, tag: u8) Error {
        return report.fail("expected {s} for {s}, got {s} at byte {d}", .{ expected, what, typeName(tag), r.pos });
    }

    fn take(r: *Reader, what: []const u8, n: usize) Error![]const u8 {
        if (n > r.buf.len - r.pos) return r.truncated(what);
        const s = r.buf[r.pos .. r.pos + n];
        r.pos += n;
        return s;
    }

    fn be(r: *Reader, comptime T: type, what: []const u8) Error!T {
        const s = try r.take(what, @sizeOf(T));
        return std.mem.readInt(T, s[0..@sizeOf(T)], .big);
    }

    /// The next tag byte, not consumed.
    pub fn peek(r: *const Reader, what: []const u8) Error!u8 {
        if (r.pos >= r.buf.len) return r.truncated(what);
        return r.buf[r.pos];
    }

    /// Consume a nil if one is next; report whether it was.
    pub fn nil(r: *Reader) bool {
        if (r.pos < r.buf.len and r.buf[r.pos] == 0xc0) {
            r.pos += 1;
            return true;
        }
        return false;
    }

    fn containerLen(r: *Reader, what: []const u8, n: u32) Error!u32 {
        // Every element takes at least one byte: a length beyond the bytes left is garbage,
        // refused before anyone allocates for it.
        if (n > r.buf.len - r.pos) return report.fail("length {d} of {s} exceeds the {d} bytes left", .{ n, what, r.buf.len - r.pos });
        return n;
    }

    pub fn arrayLen(r: *Reader, what: []const u8) Error!u32 {
        const tag = try r.peek(what);
        const n: u32 = switch (tag) {
            0x90...0x9f => blk: {
                r.pos += 1;
                break :blk tag & 0x0f;
            },
            0xdc => blk: {
                r.pos += 1;
                break :blk try r.be(u16, what);
            },
            0xdd => blk: {
                r.pos += 1;
                break :blk try r.be(u32, what);
            },
            else => return r.mismatch(what, "array", tag),
        };
        return r.containerLen(what, n);
    }

    pub fn mapLen(r: *Reader, what: []const u8) Error!u32 {
        const tag = try r.peek(what);
        const n: u32 = switch (tag) {
            0x80...0x8f => blk: {
                r.pos += 1;
                break :blk tag & 0x0f;
            },
            0xde => blk: {
                r.pos += 1;
                break :blk try r.be(u16, what);
            },
            0xdf => blk: {
                r.pos += 1;
                break :blk try r.be(u32, what);
            },
            else => return r.mismatch(what, "map", tag),
        };
        // A map entry is two values.
        if (n > (r.buf.len - r.pos) / 2) return report.fail("length {d} of {s} exceeds the {d} bytes left", .{ n, what, r.buf.len - r.pos });
        return n;
    }

    /// Any msgpack integer as i128 (covers the whole u64 and i64 ranges).
    fn anyInt(r: *Reader, what: []const u8) Error!?i128 {
        const tag = try r.peek(what);
        switch (tag) {
            0x00...0x7f => {
                r.pos += 1;
                return tag;
            },
            0xe0...0xff => {
                r.pos += 1;
                return @as(i8, @bitCast(tag));
            },
            0xcc...0xd3 => {
                r.pos += 1;
                return switch (tag) {
                    0xcc => try r.be(u8, what),
                    0xcd => try r.be(u16, what),
                    0xce => try r.be(u32, what),
                    0xcf => try r.be(u64, what),
                    0xd0 => try r.be(i8, what),
                    0xd1 => try r.be(i16, what),
                    0xd2 => try r.be(i32, what),
                    else => try r.be(i64, what),
                };
            },
            else => return null,
        }
    }

    pub fn int(r: *Reader, what: []const u8) Error!i64 {
        // A positive fixint is the byte itself: candidate indices and per-candidate counts
        // nearly always are, and the i128 path below costs several times as much in wasm.
        if (r.pos < r.buf.len and r.buf[r.pos] < 0x80) {
            r.pos += 1;
            return r.buf[r.pos - 1];
        }
        const start = r.pos;
        const v = (try r.anyInt(what)) orelse return r.mismatch(what, "int", r.buf[r.pos]);
        if (v > std.math.maxInt(i64)) {
            r.pos = start;
            return report.fail("{s} = {d} does not fit in a signed 64-bit int (byte {d})", .{ what, v, start });
        }
        return @intCast(v);
    }

    pub fn uint64(r: *Reader, what: []const u8) Error!u64 {
        const start = r.pos;
        const v = (try r.anyInt(what)) orelse return r.mismatch(what, "int", r.buf[r.pos]);
        if (v < 0) {
            r.pos = start;
            return report.fail("{s} = {d} must not be negative (byte {d})", .{ what, v, start });
        }
        return @intCast(v);
    }

    /// A float, or an int converted to one.
    pub fn float(r: *Reader, what: []const u8) Error!f64 {
        const tag = try r.peek(what);
        switch (tag) {
            0xca => {
                r.pos += 1;
                return @as(f32, @bitCast(try r.be(u32, what)));
            },
            0xcb => {
                r.pos += 1;
                return @as(f64, @bitCast(try r.be(u64, what)));
            },
            else => {
                const v = (try r.anyInt(what)) orelse return r.mismatch(what, "float", tag);
                return @floatFromInt(v);
            },
        }
    }

    pub fn boolean(r: *Reader, what: []const u8) Error!bool {
        const tag = try r.peek(what);
        if (tag != 0xc2 and tag != 0xc3) return r.mismatch(what, "bool", tag);
        r.pos += 1;
        return tag == 0xc3;
    }

    /// A str (or bin) as a slice into the input: valid only while the input is.
    pub fn str(r: *Reader, what: []const u8) Error![]const u8 {
        const tag = try r.peek(what);
        const n: usize = switch (tag) {
            0xa0...0xbf => blk: {
                r.pos += 1;
                break :blk tag & 0x1f;
            },
            0xd9, 0xc4 => blk: {
                r.pos += 1;
                break :blk try r.be(u8, what);
            },
            0xda, 0xc5 => blk: {
                r.pos += 1;
                break :blk try r.be(u16, what);
            },
            0xdb, 0xc6 => blk: {
                r.pos += 1;
                break :blk try r.be(u32, what);
            },
            else => return r.mismatch(what, "str", tag),
        };
        return r.take(what, n);
    }

    /// Skip one value of any type, however nested (iteratively: no recursion to overflow).
    pub fn skip(r: *Reader, what: []const u8) Error!void {
        var pending: u64 = 1;
        while (pending > 0) : (pending -= 1) {
            if (pending > max_skip_values) return report.fail("{s} nests too many values (byte {d})", .{ what, r.pos });
            const tag = try r.peek(what);
            switch (tag) {
                0x80...0x8f, 0xde, 0xdf => pending += 2 * @as(u64, try r.mapLen(what)),
                0x90...0x9f, 0xdc, 0xdd => pending += try r.arrayLen(what),
                0xa0...0xbf, 0xd9...0xdb, 0xc4...0xc6 => _ = try r.str(what),
                0x00...0x7f, 0xe0...0xff, 0xc0, 0xc2, 0xc3 => r.pos += 1,
                0xcc...0xd3 => _ = try r.anyInt(what),
                0xca => _ = try r.take(what, 5),
                0xcb => _ = try r.take(what, 9),
                0xd4 => _ = try r.take(what, 3),
                0xd5 => _ = try r.take(what, 4),
                0xd6 => _ = try r.take(what, 6),
                0xd7 => _ = try r.take(what, 10),
                0xd8 => _ = try r.take(what, 18),
                0xc7, 0xc8, 0xc9 => {
                    r.pos += 1;
                    const n: usize = switch (tag) {
                        0xc7 => try r.be(u8, what),
                        0xc8 => try r.be(u16, what),
                        else => try r.be(u32, what),
                    };
                    _ = try r.take(what, n + 1);
                },
                0xc1 => return r.mismatch(what, "a msgpack value", tag),
            }
        }
    }

    /// Skip `n` values: the trailing elements of a layout this policy does not know.
    pub fn skipN(r: *Reader, what: []const u8, n: u32) Error!void {
        var i: u32 = 0;
        while (i < n) : (i += 1) try r.skip(what);
    }
};

/// Appends msgpack to a growable byte buffer.
pub const Writer = struct {
    list: *std.ArrayList(u8),
    gpa: std.mem.Allocator,

    fn put(w: *Writer, bytes: []const u8) Error!void {
        try w.list.appendSlice(w.gpa, bytes);
    }

    fn tagged(w: *Writer, tag: u8, comptime T: type, v: T) Error!void {
        var b: [1 + @sizeOf(T)]u8 = undefined;
        b[0] = tag;
        std.mem.writeInt(T, b[1..], v, .big);
        try w.put(&b);
    }

    pub fn nil(w: *Writer) Error!void {
        try w.put(&.{0xc0});
    }

    pub fn boolean(w: *Writer, v: bool) Error!void {
        try w.put(&.{if (v) 0xc3 else 0xc2});
    }

    pub fn uint(w: *Writer, v: u64) Error!void {
        if (v < 0x80) return w.put(&.{@intCast(v)});
        if (v <= 0xff) return w.tagged(0xcc, u8, @intCast(v));
        if (v <= 0xffff) return w.tagged(0xcd, u16, @intCast(v));
        if (v <= 0xffff_ffff) return w.tagged(0xce, u32, @intCast(v));
        return w.tagged(0xcf, u64, v);
    }

    pub fn int(w: *Writer, v: i64) Error!void {
        if (v >= 0) return w.uint(@intCast(v));
        if (v >= -32) return w.put(&.{@bitCast(@as(i8, @intCast(v)))});
        if (v >= std.math.minInt(i8)) return w.tagged(0xd0, i8, @intCast(v));
        if (v >= std.math.minInt(i16)) return w.tagged(0xd1, i16, @intCast(v));
        if (v >= std.math.minInt(i32)) return w.tagged(0xd2, i32, @intCast(v));
        return w.tagged(0xd3, i64, v);
    }

    pub fn float(w: *Writer, v: f64) Error!void {
        try w.tagged(0xcb, u64, @bitCast(v));
    }

    pub fn str(w: *Writer, s: []const u8) Error!void {
        const n: u32 = @intCast(s.len);
        if (n < 32) {
            try w.put(&.{0xa0 | @as(u8, @intCast(n))});
        } else if (n <= 0xff) {
            try w.tagged(0xd9, u8, @intCast(n));
        } else if (n <= 0xffff) {
            try w.tagged(0xda, u16, @intCast(n));
        } else {
            try w.tagged(0xdb, u32, n);
        }
        try w.put(s);
    }

    pub fn bin(w: *Writer, s: []const u8) Error!void {
        const n: u32 = @intCast(s.len);
        if (n <= 0xff) {
            try w.tagged(0xc4, u8, @intCast(n));
        } else if (n <= 0xffff) {
            try w.tagged(0xc5, u16, @intCast(n));
        } else {
            try w.tagged(0xc6, u32, n);
        }
        try w.put(s);
    }

    pub fn arrayHeader(w: *Writer, n: u32) Error!void {
        if (n < 16) return w.put(&.{0x90 | @as(u8, @intCast(n))});
        if (n <= 0xffff) return w.tagged(0xdc, u16, @intCast(n));
        return w.tagged(0xdd, u32, n);
    }

    pub fn mapHeader(w: *Writer, n: u32) Error!void {
        if (n < 16) return w.put(&.{0x80 | @as(u8, @intCast(n))});
        if (n <= 0xffff) return w.tagged(0xde, u16, @intCast(n));
        return w.tagged(0xdf, u32, n);
    }
};
