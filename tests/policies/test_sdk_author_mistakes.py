"""A policy author's mistakes, caught by the SDK: a misspelt hook does not build (it
would never be called), and a @panic's message reaches the host beside the trap."""

from __future__ import annotations

import pytest
from policy_payloads import ep, score_input, snap

from epick.policies_build import BuildError, Policy, build
from epick.runtime import PolicyTrap

HEAD = """const sdk = @import("epick");
pub const name = "mine";
pub const version = "0.1.0";
pub const kind = "custom";
"""
PANIC = "pub const panic = sdk.panic;\n"
SCORE = """pub fn score(ctx: *const sdk.ScoreCtx, out: []f64) sdk.Error!void {
    if (ctx.candidates.len == 4) @trap();
    if (ctx.candidates.len > 2) @panic("too many running");
    if (ctx.candidates.len == 2) return sdk.fail("two is refused", .{});
    for (out) |*o| o.* = 0.5;
}
"""
TAIL = "comptime {\n    sdk.exportPolicy(@This());\n}\n"


def build_source(tmp_path, source: str):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "main.zig").write_text(source)
    return build(Policy("mine", folder, "zig"), tmp_path / "out")


@pytest.mark.parametrize("declared, meant", [
    ("pre_request", "preRequest"),   # snake_case, as the ABI's export is spelt
    ("PostResponse", "postResponse"),  # case
    ("preRequst", "preRequest"),     # a typo
])
def test_a_misspelt_hook_is_a_build_error_naming_the_hook(tmp_path, declared, meant):
    hook = f"pub fn {declared}(ev: *const sdk.PreRequest) sdk.Error!void {{\n    _ = ev;\n}}\n"
    with pytest.raises(BuildError) as info:
        build_source(tmp_path, HEAD + PANIC + SCORE + hook + TAIL)
    assert (f"policy 'mine' declares `pub {declared}`, which the SDK never calls: did you "
            f"mean `{meant}`?") in str(info.value)


def test_a_policy_without_the_panic_handler_is_told_the_line_to_add(tmp_path):
    with pytest.raises(BuildError) as info:
        build_source(tmp_path, HEAD + SCORE + TAIL)
    assert "policy 'mine': add `pub const panic = sdk.panic;` to its root file" in str(
        info.value)


#: Other public declarations are the author's own: they build (one build serves both tests).
EXTRA = "pub const Profile = enum { a, b };\npub fn store() void {}\npub fn scores() void {}\n"


def test_a_panic_message_reaches_the_host_and_never_goes_stale(tmp_path, runtime):
    wasm = build_source(tmp_path, HEAD + PANIC + SCORE + EXTRA + TAIL).read_bytes()
    inst = runtime.compile(wasm, name="mine").instantiate({})
    pool = snap([ep(f"e{i}:1") for i in range(4)])
    with pytest.raises(PolicyTrap) as info:
        inst.score(score_input(pool, candidates=[0, 1, 2]), 3)
    assert str(info.value) == ("policy 'mine': score trapped: wasm trap: wasm `unreachable` "
                               "instruction executed (panic: too many running)")
    # The next call starts clean: a trap without a panic quotes nothing old.
    with pytest.raises(PolicyTrap) as info:
        inst.score(score_input(pool), 4)
    assert "panic" not in str(info.value)
    # A failed call reports its own message, and the instance still answers.
    inst = runtime.compile(wasm, name="mine").instantiate({})
    with pytest.raises(Exception, match="two is refused"):
        inst.score(score_input(pool, candidates=[0, 1]), 2)
    assert list(inst.score(score_input(pool, candidates=[0]), 1)) == [0.5]
