//! Params: the msgpack map `init` receives, decoded into a policy's `Params` struct.
//!
//! The struct *is* the schema: each field is a parameter, its default value the default
//! `describe` reports. Supported field types: `f64`, integers, `bool`, enums (given as
//! their tag name, a string) and `[]const u8`. Unknown keys and ill-typed values are
//! errors naming the key. A `Params.check` method, when declared, validates the whole set
//! after decoding (ranges, cross-field rules).

const std = @import("std");
const msgpack = @import("msgpack.zig");
const report = @import("report.zig");

pub const Error = report.Error;

fn knownKeys(comptime P: type) []const u8 {
    comptime {
        var s: []const u8 = "";
        for (@typeInfo(P).@"struct".field_names, 0..) |f, i| s = s ++ (if (i == 0) "" else ", ") ++ f;
        return if (s.len == 0) "none" else s;
    }
}

fn typeWord(tag: u8) []const u8 {
    return switch (tag) {
        0x00...0x7f, 0xe0...0xff, 0xcc...0xd3 => "an int",
        0xca, 0xcb => "a float",
        0xa0...0xbf, 0xd9...0xdb => "a string",
        0xc2, 0xc3 => "a bool",
        0xc0 => "nil",
        0x80...0x8f, 0xde, 0xdf => "a map",
        0x90...0x9f, 0xdc, 0xdd => "an array",
        else => "another type",
    };
}

fn readField(comptime T: type, comptime key: []const u8, r: *msgpack.Reader, arena: std.mem.Allocator) Error!T {
    const tag = try r.peek("param '" ++ key ++ "'");
    switch (@typeInfo(T)) {
        .float => switch (tag) {
            0x00...0x7f, 0xe0...0xff, 0xcc...0xd3, 0xca, 0xcb => return @floatCast(try r.float(key)),
            else => return report.fail("param '" ++ key ++ "': expected a number, got {s}", .{typeWord(tag)}),
        },
        .int => switch (tag) {
            0x00...0x7f, 0xe0...0xff, 0xcc...0xd3 => {
                const v = try r.int(key);
                return std.math.cast(T, v) orelse
                    report.fail("param '" ++ key ++ "': {d} is out of range [{d}, {d}]", .{ v, std.math.minInt(T), std.math.maxInt(T) });
            },
            else => return report.fail("param '" ++ key ++ "': expected an int, got {s}", .{typeWord(tag)}),
        },
        .bool => switch (tag) {
            0xc2, 0xc3 => return try r.boolean(key),
            else => return report.fail("param '" ++ key ++ "': expected a bool, got {s}", .{typeWord(tag)}),
        },
        .@"enum" => |info| switch (tag) {
            0xa0...0xbf, 0xd9...0xdb => {
                const s = try r.str(key);
                inline for (info.field_names) |ef| {
                    if (std.mem.eql(u8, s, ef)) return @field(T, ef);
                }
                return report.fail("param '" ++ key ++ "': '{s}' is not one of " ++ comptime enumNames(T), .{s});
            },
            else => return report.fail("param '" ++ key ++ "': expected a string, got {s}", .{typeWord(tag)}),
        },
        .pointer => switch (tag) {
            0xa0...0xbf, 0xd9...0xdb => return try arena.dupe(u8, try r.str(key)),
            else => return report.fail("param '" ++ key ++ "': expected a string, got {s}", .{typeWord(tag)}),
        },
        else => @compileError("unsupported param type " ++ @typeName(T) ++ " for '" ++ key ++ "'"),
    }
}

fn enumNames(comptime T: type) []const u8 {
    comptime {
        var s: []const u8 = "";
        for (@typeInfo(T).@"enum".field_names, 0..) |f, i| s = s ++ (if (i == 0) "'" else ", '") ++ f ++ "'";
        return s;
    }
}

/// Decode a params map into `P`, starting from its defaults. Strings are copied into
/// `arena` (params outlive the call).
pub fn decode(comptime P: type, bytes: []const u8, arena: std.mem.Allocator) Error!P {
    var r = msgpack.Reader.init(bytes);
    var p: P = .{};
    const n = try r.mapLen("params (a map of name to value)");
    var i: u32 = 0;
    outer: while (i < n) : (i += 1) {
        const key = try r.str("a param name");
        const info = @typeInfo(P).@"struct";
        inline for (info.field_names, info.field_types) |fname, ftype| {
            if (std.mem.eql(u8, key, fname)) {
                @field(p, fname) = try readField(ftype, fname, &r, arena);
                continue :outer;
            }
        }
        return report.fail("unknown param '{s}' (known: " ++ comptime knownKeys(P) ++ ")", .{key});
    }
    if (!r.atEnd()) return report.fail("{d} unexpected bytes after the params map", .{r.buf.len - r.pos});
    if (@hasDecl(P, "check")) try p.check();
    return p;
}

/// Write every parameter of `p` as a msgpack map (for `describe`: pass the defaults).
pub fn write(comptime P: type, p: *const P, w: *msgpack.Writer) Error!void {
    const info = @typeInfo(P).@"struct";
    try w.mapHeader(info.field_names.len);
    inline for (info.field_names, info.field_types) |fname, ftype| {
        try w.str(fname);
        const v = @field(p, fname);
        switch (@typeInfo(ftype)) {
            .float => try w.float(v),
            .int => try w.int(@intCast(v)),
            .bool => try w.boolean(v),
            .@"enum" => try w.str(@tagName(v)),
            .pointer => try w.str(v),
            else => unreachable,
        }
    }
}
