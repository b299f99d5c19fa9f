//! Error reporting (ABI: a non-zero status, then `error_ptr`/`error_len` name the cause).
//!
//! Policy code never returns a bare error: it calls `fail`, which formats the message into
//! a fixed buffer and hands back `error.Invalid` to `return`. Messages longer than the
//! buffer are cut, never an error in themselves.

const std = @import("std");

pub const Error = error{ Invalid, OutOfMemory };

var buf: [1024]u8 = undefined;
var len: usize = 0;

/// Record the message of the failing call and return the error to propagate.
pub fn fail(comptime fmt: []const u8, args: anytype) Error {
    len = if (std.fmt.bufPrint(&buf, fmt, args)) |s| s.len else |_| buf.len;
    return error.Invalid;
}

/// Called by the export wrappers: turn an error into the status and message the host reads.
pub fn status(err: Error) i32 {
    switch (err) {
        error.Invalid => {},
        error.OutOfMemory => {
            const msg = "out of memory (the instance hit its memory cap)";
            @memcpy(buf[0..msg.len], msg);
            len = msg.len;
        },
    }
    return 1;
}

/// Forget the last message (every exported call starts with a clean slate, so whatever is
/// there after a trap was written by that call: a panic's message).
pub fn clear() void {
    len = 0;
}

/// Record a panic's message as `panic: MSG`, for the host to quote beside the trap.
pub fn panicked(msg: []const u8) void {
    const prefix = "panic: ";
    @memcpy(buf[0..prefix.len], prefix);
    const n = @min(msg.len, buf.len - prefix.len);
    @memcpy(buf[prefix.len..][0..n], msg[0..n]);
    len = prefix.len + n;
}

pub fn ptr() usize {
    return @intFromPtr(&buf);
}

pub fn length() usize {
    return len;
}
