"""Runtime.compile: what a module must be to load, and what the errors say."""

from __future__ import annotations

import msgspec
import pytest
import wasmtime
from wat_modules import wasm, wat_source

from epick.runtime import Limits, PolicyLoadError, Runtime

SCORE = '(func (export "score") (param i32 i32 i32) (result i32) (i32.const 0))'


def minimal(abi_version: int = 1, score: str = SCORE, extra: str = "") -> bytes:
    return wasm("minimal", abi_version=abi_version, score=score, extra=extra)


def test_a_minimal_module_loads_with_its_name_hash_size_and_exports(runtime):
    data = minimal()
    mod = runtime.compile(data, name="tiny")
    assert mod.name == "tiny"
    assert mod.size == len(data)
    assert len(mod.sha256) == 64
    assert mod.exports == {
        "memory", "epick_abi_version", "alloc", "error_ptr", "error_len", "init", "score",
    }


def test_bytes_that_are_not_wasm_are_refused_by_name(runtime):
    with pytest.raises(PolicyLoadError) as err:
        runtime.compile(b"#!/bin/sh\necho hi\n", name="script")
    assert str(err.value) == (
        "policy 'script': not a WebAssembly module (starts with b'#!/bin/s', expected b'\\x00asm')"
    )
    assert err.value.policy == "script"


def test_wat_text_is_not_accepted_as_a_module(runtime):
    with pytest.raises(PolicyLoadError, match="not a WebAssembly module"):
        runtime.compile(wat_source("minimal", abi_version=1, score=SCORE, extra="").encode(), name="text")


def test_truncated_wasm_is_invalid_webassembly(runtime):
    with pytest.raises(PolicyLoadError, match=r"^policy 'cut': invalid WebAssembly: "):
        runtime.compile(minimal()[:-5], name="cut")


def test_a_module_without_score_or_filter_is_refused(runtime):
    with pytest.raises(PolicyLoadError) as err:
        runtime.compile(minimal(score=""), name="x")
    assert str(err.value) == (
        "policy 'x': missing export 'score' or 'filter' (its exports: alloc, epick_abi_version, "
        "error_len, error_ptr, init, memory)")


@pytest.mark.parametrize("export", ["epick_abi_version", "alloc", "error_ptr", "error_len", "init"])
def test_each_required_export_is_named_when_missing(runtime, export):
    source = wat_source("minimal", abi_version=1, score=SCORE, extra="")
    source = source.replace(f'(export "{export}")', "")
    with pytest.raises(PolicyLoadError) as err:
        runtime.compile(wasmtime.wat2wasm(source), name="x")
    assert str(err.value) == f"policy 'x': missing export {export!r}"
    assert err.value.export == export


def test_a_module_without_memory_is_refused(runtime):
    source = wat_source("minimal", abi_version=1, score=SCORE, extra="")
    source = source.replace('(memory (export "memory") 1)', "(memory 1)")
    with pytest.raises(PolicyLoadError) as err:
        runtime.compile(wasmtime.wat2wasm(source), name="x")
    assert str(err.value) == "policy 'x': missing export 'memory'"


@pytest.mark.parametrize(
    "score, message",
    [
        pytest.param(
            '(func (export "score") (param i32 i32) (result i32) (i32.const 0))',
            "export 'score' has signature (i32, i32) -> i32, expected (i32, i32, i32) -> i32",
            id="too-few-params",
        ),
        pytest.param(
            '(func (export "score") (param i32 i32 i32))',
            "export 'score' has signature (i32, i32, i32) -> (), expected (i32, i32, i32) -> i32",
            id="no-result",
        ),
        pytest.param(
            '(func (export "score") (param i32 i32 i64) (result i32) (i32.const 0))',
            "export 'score' has signature (i32, i32, i64) -> i32, expected (i32, i32, i32) -> i32",
            id="i64-param",
        ),
        pytest.param(
            '(global (export "score") i32 (i32.const 0))',
            "export 'score' is a global, expected a function",
            id="a-global",
        ),
    ],
)
def test_an_export_with_the_wrong_signature_is_refused(runtime, score, message):
    with pytest.raises(PolicyLoadError) as err:
        runtime.compile(minimal(score=score), name="x")
    assert str(err.value) == f"policy 'x': {message}"


def test_init_with_one_param_names_both_signatures(runtime):
    source = wat_source("minimal", abi_version=1, score=SCORE, extra="")
    source = source.replace(
        '(func (export "init") (param i32 i32) (result i32) (i32.const 0))',
        '(func (export "init") (param i32) (result i32) (i32.const 0))',
    )
    with pytest.raises(PolicyLoadError) as err:
        runtime.compile(wasmtime.wat2wasm(source), name="x")
    assert str(err.value) == (
        "policy 'x': export 'init' has signature (i32) -> i32, expected (i32, i32) -> i32"
    )


def test_describe_without_output_ptr_is_refused(runtime):
    extra = '(func (export "describe") (result i32) (i32.const 0))'
    with pytest.raises(PolicyLoadError) as err:
        runtime.compile(minimal(extra=extra), name="x")
    assert str(err.value) == "policy 'x': missing export 'output_ptr' (required with 'describe')"


def test_a_module_that_imports_anything_is_refused(runtime):
    extra = '(import "env" "now" (func (result i64)))'
    source = wat_source("minimal", abi_version=1, score=SCORE, extra="")
    source = source.replace("(module", "(module " + extra, 1)
    with pytest.raises(PolicyLoadError) as err:
        runtime.compile(wasmtime.wat2wasm(source), name="x")
    assert str(err.value) == "policy 'x': imports 'env.now'; a policy must import nothing"


def test_extra_exports_the_abi_does_not_name_are_allowed(runtime):
    mod = runtime.compile(minimal(extra='(global (export "__heap_base") i32 (i32.const 4096))'), name="x")
    assert "__heap_base" in mod.exports


def test_a_wrong_abi_version_is_refused_naming_both_versions(runtime):
    with pytest.raises(PolicyLoadError) as err:
        runtime.compile(minimal(abi_version=3), name="future")
    assert str(err.value) == "policy 'future': ABI version 3, this host speaks 1 and 2"
    assert err.value.export == "epick_abi_version"


def test_a_module_needing_more_memory_than_the_cap_cannot_instantiate():
    source = wat_source("minimal", abi_version=1, score=SCORE, extra="")
    source = source.replace('(memory (export "memory") 1)', '(memory (export "memory") 32)')
    with Runtime(Limits(memory_bytes=1 << 20)) as rt:
        with pytest.raises(PolicyLoadError, match=r"^policy 'big': cannot instantiate: "):
            rt.compile(wasmtime.wat2wasm(source), name="big")


def test_compiled_artifacts_are_cached_on_disk_and_reused_once_kept(tmp_path):
    data = wasm("counter")
    with Runtime(cache_dir=tmp_path) as rt:
        first = rt.compile(data, name="counter")
        assert list(tmp_path.glob("*.cwasm")) == [] and rt.cached_modules == frozenset()
        rt.keep(first)
        assert rt.cached_modules == {first.sha256}
    artifacts = list(tmp_path.glob("*.cwasm"))
    assert [p.name.split("-")[0] for p in artifacts] == [first.sha256]
    with Runtime(cache_dir=tmp_path) as rt:
        assert rt._cache.load(rt.engine, first.sha256) is not None  # what compile will use
        again = rt.compile(data, name="counter")
        assert again.instantiate().export_state() == b"\0" * 8


def test_a_corrupt_cached_artifact_is_recompiled(tmp_path):
    data = wasm("counter")
    with Runtime(cache_dir=tmp_path) as rt:
        rt.keep(rt.compile(data, name="counter"))
    (artifact,) = tmp_path.glob("*.cwasm")
    artifact.write_bytes(b"garbage")
    with Runtime(cache_dir=tmp_path) as rt:
        mod = rt.compile(data, name="counter")
        assert mod.instantiate().export_state() == b"\0" * 8
        rt.keep(mod)
    assert artifact.read_bytes() != b"garbage"


def test_a_closed_runtime_refuses_to_compile():
    rt = Runtime()
    rt.close()
    rt.close()  # idempotent
    assert rt.closed
    with pytest.raises(RuntimeError, match="Runtime is closed"):
        rt.compile(minimal(), name="x")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("budget_ms", 0.0, "Limits.budget_ms must be in [0.01, 60000], got 0.0"),
        ("memory_bytes", 1000, "Limits.memory_bytes must be in [65536, 4 GiB] (one wasm page at least), got 1000"),
        ("breaker_failures", 0, "Limits.breaker_failures must be >= 1, got 0"),
        ("breaker_cooldown_s", -1.0, "Limits.breaker_cooldown_s must be >= 0, got -1.0"),
    ],
)
def test_limits_reject_bad_values_naming_the_field(field, value, message):
    with pytest.raises(ValueError) as err:
        Limits(**{field: value})
    assert str(err.value) == message


def test_limits_decode_from_config_with_a_path_in_the_error():
    with pytest.raises(msgspec.ValidationError) as err:
        msgspec.convert({"budget_ms": 2.0, "memory_byts": 1}, Limits)
    assert str(err.value) == "Object contains unknown field `memory_byts`"
