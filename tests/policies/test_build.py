"""The committed policies/dist/*.wasm are exactly what the sources build to, import
nothing, and export the ABI their hooks promise."""

from __future__ import annotations

from pathlib import Path

import pytest
import wasmtime

from epick import policies_build

DIST = policies_build.POLICIES_DIR / "dist"
NAMES = [p.name for p in policies_build.discover()]

ABI_REQUIRED = {"memory", "epick_abi_version", "alloc", "error_ptr", "error_len", "init"}


def test_every_policy_directory_is_discovered():
    assert NAMES == ["example-c", "legacy-v1", "load", "lora-affinity", "prefix-cache"]


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    policies_build.build_all(out)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_the_committed_wasm_is_what_the_sources_build_to(rebuilt, name):
    fresh = (rebuilt / f"{name}.wasm").read_bytes()
    committed = (DIST / f"{name}.wasm").read_bytes()
    assert fresh == committed, f"policies/dist/{name}.wasm is stale: run `make policies` and commit it"


@pytest.mark.parametrize("name", NAMES)
def test_a_policy_imports_nothing(name):
    module = wasmtime.Module(wasmtime.Engine(), (DIST / f"{name}.wasm").read_bytes())
    assert module.imports == []


EXPECTED_EXPORTS = {
    "load": {"score", "set_snapshot", "describe", "output_ptr", "output_len"},
    "lora-affinity": {"score", "set_snapshot", "pre_request", "post_response", "describe", "export_state",
                      "import_state", "output_ptr", "output_len"},
    "prefix-cache": {"score", "set_snapshot", "pre_request", "describe", "export_state", "import_state",
                     "output_ptr", "output_len"},
    "legacy-v1": {"filter", "score", "set_snapshot", "describe", "output_ptr", "output_len"},
    "example-c": {"score", "describe", "output_ptr", "output_len"},
}


@pytest.mark.parametrize("name", NAMES)
def test_a_policy_exports_the_abi_and_its_hooks(name):
    module = wasmtime.Module(wasmtime.Engine(), (DIST / f"{name}.wasm").read_bytes())
    assert {e.name for e in module.exports} == ABI_REQUIRED | EXPECTED_EXPORTS[name]


def test_a_compile_error_names_the_policy(tmp_path, monkeypatch):
    src = tmp_path / "policies"
    (src / "broken").mkdir(parents=True)
    (src / "broken" / "main.zig").write_text('comptime {\n    @compileError("broken on purpose");\n}\n')
    monkeypatch.setattr(policies_build, "POLICIES_DIR", src)
    (src / "sdk").symlink_to(DIST.parent / "sdk")
    with pytest.raises(policies_build.BuildError) as info:
        policies_build.build_all(tmp_path / "out")
    assert str(info.value).startswith("policy 'broken': zig exited with 1:")
    assert "broken on purpose" in str(info.value)


def test_an_unknown_policy_name_is_refused(tmp_path):
    with pytest.raises(policies_build.BuildError) as info:
        policies_build.build_all(tmp_path, ["nope"])
    assert str(info.value) == (
        f"policy 'nope': no such policy under {policies_build.POLICIES_DIR} "
        "(known: example-c, legacy-v1, load, lora-affinity, prefix-cache)"
    )


def test_another_zig_version_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(policies_build, "ZIG_VERSION", "0.0.1")
    with pytest.raises(policies_build.BuildError) as info:
        policies_build.build_all(tmp_path)
    assert str(info.value) == "the policies build with Zig 0.0.1 (pip install ziglang==0.0.1), found '0.17.1'"
