"""The committed host/builtin/*.wasm (package epick.builtin) are exactly what the sources build to, import
nothing, and export the ABI their hooks promise."""

from __future__ import annotations

from pathlib import Path

import pytest
import wasmtime

from epick import policies_build
from epick.config import BUILTIN_POLICY_DIR

DIST = BUILTIN_POLICY_DIR
NAMES = [p.name for p in policies_build.discover()]

ABI_REQUIRED = {"memory", "epick_abi_version", "alloc", "error_ptr", "error_len", "init"}


#: The policies epick ships; a policy an author adds beside them is discovered too.
BUILTINS = ["example-c", "legacy-v1", "load", "lora-affinity", "precise-prefix", "prefix-cache"]


def test_every_policy_directory_is_discovered():
    root = policies_build.POLICIES_DIR
    dirs = sorted(d.name for d in root.iterdir() if d.is_dir() and d.name != "sdk"
                  and ((d / "main.zig").is_file() or any(d.glob("*.c"))))
    assert NAMES == dirs
    assert set(BUILTINS) <= set(NAMES)


def test_make_policies_writes_where_the_built_ins_are_read():
    assert policies_build.BUILTIN_DIR == DIST
    assert (DIST / "__init__.py").is_file()  # a package: a wheel carries its .wasm


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    policies_build.build_all(out)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_the_committed_wasm_is_what_the_sources_build_to(rebuilt, name):
    fresh = (rebuilt / f"{name}.wasm").read_bytes()
    assert (DIST / f"{name}.wasm").is_file(), (
        f"host/builtin/{name}.wasm is missing: run `make policies` and commit it")
    committed = (DIST / f"{name}.wasm").read_bytes()
    assert fresh == committed, f"host/builtin/{name}.wasm is stale: run `make policies` and commit it"


@pytest.mark.parametrize("name", NAMES)
def test_a_policy_imports_nothing(name):
    module = wasmtime.Module(wasmtime.Engine(), (DIST / f"{name}.wasm").read_bytes())
    assert module.imports == []


EXPECTED_EXPORTS = {
    "load": {"score", "set_snapshot", "pre_request", "describe", "output_ptr", "output_len"},
    "lora-affinity": {"score", "set_snapshot", "pre_request", "post_response", "describe", "export_state",
                      "import_state", "output_ptr", "output_len"},
    "prefix-cache": {"score", "set_snapshot", "pre_request", "describe", "export_state", "import_state",
                     "output_ptr", "output_len"},
    "precise-prefix": {"score", "set_snapshot", "pre_request", "describe", "export_state",
                       "import_state", "output_ptr", "output_len"},
    "legacy-v1": {"filter", "score", "set_snapshot", "describe", "output_ptr", "output_len"},
    "example-c": {"score", "describe", "output_ptr", "output_len"},
}


def expected_exports(policy: policies_build.Policy) -> set[str]:
    """What a policy must export: pinned for the built-ins, from its hooks for the rest."""
    if policy.name in EXPECTED_EXPORTS:
        return ABI_REQUIRED | EXPECTED_EXPORTS[policy.name]
    if policy.language == "zig":
        return {"memory", *policies_build.zig_exports(policy.source_dir / "main.zig")}
    return ABI_REQUIRED  # C: whatever else its export_name attributes add


@pytest.mark.parametrize("policy", policies_build.discover(), ids=lambda p: p.name)
def test_a_policy_exports_the_abi_and_its_hooks(policy):
    module = wasmtime.Module(wasmtime.Engine(), (DIST / f"{policy.name}.wasm").read_bytes())
    exports = {e.name for e in module.exports}
    if policy.language == "c" and policy.name not in EXPECTED_EXPORTS:
        assert ABI_REQUIRED <= exports
    else:
        assert exports == expected_exports(policy)


def test_a_copied_policy_is_discovered_and_checked_like_the_built_ins(tmp_path, monkeypatch):
    # The guide's step 1 is `cp -r policies/load policies/my-policy`: the suite must take
    # the new folder in its stride (it used to hard-code the list of policy folders).
    import shutil

    src = tmp_path / "policies"
    src.mkdir()
    shutil.copytree(policies_build.POLICIES_DIR / "load", src / "load")
    shutil.copytree(policies_build.POLICIES_DIR / "load", src / "my-policy")
    (src / "sdk").symlink_to(policies_build.POLICIES_DIR / "sdk")
    monkeypatch.setattr(policies_build, "POLICIES_DIR", src)
    found = {p.name: p for p in policies_build.discover()}
    assert sorted(found) == ["load", "my-policy"]
    (built,) = policies_build.build_all(tmp_path / "out", ["my-policy"])
    module = wasmtime.Module(wasmtime.Engine(), built.read_bytes())
    assert {e.name for e in module.exports} == expected_exports(found["my-policy"])
    assert expected_exports(found["my-policy"]) == expected_exports(found["load"])


def test_a_compile_error_names_the_policy(tmp_path, monkeypatch):
    src = tmp_path / "policies"
    (src / "broken").mkdir(parents=True)
    (src / "broken" / "main.zig").write_text('comptime {\n    @compileError("broken on purpose");\n}\n')
    monkeypatch.setattr(policies_build, "POLICIES_DIR", src)
    (src / "sdk").symlink_to(policies_build.POLICIES_DIR / "sdk")
    with pytest.raises(policies_build.BuildError) as info:
        policies_build.build_all(tmp_path / "out")
    assert str(info.value).startswith("policy 'broken': zig exited with 1:")
    assert "broken on purpose" in str(info.value)


def test_an_unknown_policy_name_is_refused(tmp_path):
    with pytest.raises(policies_build.BuildError) as info:
        policies_build.build_all(tmp_path, ["nope"])
    assert str(info.value) == (
        f"policy 'nope': no such policy under {policies_build.POLICIES_DIR} "
        f"(known: {', '.join(NAMES)})"
    )


def test_another_zig_version_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(policies_build, "ZIG_VERSION", "0.0.1")
    with pytest.raises(policies_build.BuildError) as info:
        policies_build.build_all(tmp_path)
    assert str(info.value) == "the policies build with Zig 0.0.1 (pip install ziglang==0.0.1), found '0.17.1'"
