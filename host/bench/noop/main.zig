//! noop — a policy that does nothing but what every SDK policy does: its score and
//! pre_request run the SDK's entry, decode their input (ScoreInput, PreRequestEvent) and
//! write constant scores. `python -m epick.bench.stages` times it on the inputs the real
//! policies got: the guest's decode, apart from each policy's own work. Not a built-in.

const sdk = @import("epick");

pub const name = "noop";
pub const version = "1.0.0";
pub const kind = "custom";
pub const panic = sdk.panic;

pub fn score(ctx: *const sdk.ScoreCtx, out: []f64) sdk.Error!void {
    _ = ctx;
    @memset(out, 0.5);
}

pub fn preRequest(ev: *const sdk.PreRequest) sdk.Error!void {
    _ = ev;
}

comptime {
    sdk.exportPolicy(@This());
}
