"""A policy author's mistakes, caught by the SDK: a misspelt hook does not build (it
would never be called), nor does `Params` without `init` (its params would never apply),
and a @panic's message reaches the host beside the trap."""

from __future__ import annotations

import pytest
from policy_payloads import PolicyLoadError, ep, score_input, snap

from epick.policies_build import POLICIES_DIR as POLICIES
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


# --- typos that used to build: issue 32 ------------------------------------------------

PARAMS = """pub const Params = struct {
    kv_limit: f64 = 1.0,
};
"""
HOOKS = "init, score, filter, onSnapshot, preRequest, postResponse, exportState, importState, resident_snapshot"
SCORE_BODY = "{\n    _ = ctx;\n    for (out) |*o| o.* = 0.5;\n}\n"


def refused(tmp_path, source: str) -> str:
    with pytest.raises(BuildError) as info:
        build_source(tmp_path, source)
    return str(info.value)


@pytest.mark.parametrize("declared, source, meant", [
    # The only scoring function, two letters swapped: it used to get "a policy declares
    # score or filter (or both)", which does not name it.
    ("scroe", "pub fn scroe(ctx: *const sdk.ScoreCtx, out: []f64) sdk.Error!void " + SCORE_BODY,
     "score"),
    # `inti` beside Params: it built, passed conformance, and never applied a param.
    ("inti", PARAMS + "pub fn inti(p: *const Params) sdk.Error!void {\n    _ = p;\n}\n" + SCORE,
     "init"),
    # A second hook misspelt beside a real one.
    ("filtr", SCORE + "pub fn filtr(ctx: *const sdk.ScoreCtx, keep: []u8) sdk.Error!void "
                      "{\n    _ = ctx;\n    _ = keep;\n}\n", "filter"),
])
def test_a_hook_shaped_function_near_a_hook_name_is_a_build_error(tmp_path, declared, source,
                                                                   meant):
    assert (f"policy 'mine' declares `pub {declared}`, which the SDK never calls: did you mean "
            f"`{meant}`? (hooks: {HOOKS})") in refused(tmp_path, HEAD + PANIC + source + TAIL)


def test_params_without_init_is_a_build_error_naming_a_near_miss(tmp_path):
    # `inti` of another shape is no hook, but Params without init never applies a param.
    source = HEAD + PANIC + PARAMS + "pub fn inti() void {}\n" + SCORE + TAIL
    assert ("policy 'mine' declares `Params` but no `init`, so its params would be read and "
            "never applied: add `pub fn init(p: *const Params) sdk.Error!void`; `pub inti` is "
            "not `init`: did you mean `init`?") in refused(tmp_path, source)


def test_params_without_init_is_a_build_error_even_with_no_near_miss(tmp_path):
    message = refused(tmp_path, HEAD + PANIC + PARAMS + SCORE + TAIL)
    assert ("policy 'mine' declares `Params` but no `init`, so its params would be read and "
            "never applied: add `pub fn init(p: *const Params) sdk.Error!void`\n") in message + "\n"


def test_no_score_nor_filter_names_the_declaration_that_was_meant(tmp_path):
    source = HEAD + PANIC + "pub fn scroe() void {}\n" + TAIL
    assert ("policy 'mine' declares neither `score` nor `filter`; a policy declares one (or "
            "both); `pub scroe` is not `score`: did you mean `score`?") in refused(tmp_path,
                                                                                    source)


def test_a_c_policy_exporting_a_misspelt_score_is_refused_naming_its_exports(tmp_path, runtime):
    folder = tmp_path / "mine-c"
    folder.mkdir()
    source = (POLICIES / "example-c" / "least_running.c").read_text()
    assert source.count("EPICK_EXPORT(score)") == 1
    (folder / "least_running.c").write_text(
        source.replace("EPICK_EXPORT(score)", "EPICK_EXPORT(scroe)"))
    wasm = build(Policy("mine-c", folder, "c"), tmp_path / "out").read_bytes()
    with pytest.raises(PolicyLoadError) as info:
        runtime.compile(wasm, name="mine-c")
    assert str(info.value) == (
        "policy 'mine-c': missing export 'score' or 'filter': did you mean 'score', not "
        "'scroe'? (its exports: alloc, describe, epick_abi_version, error_len, error_ptr, "
        "init, memory, output_len, output_ptr, scroe)")
