"""Hostile modules that pass for a policy and then try to take more than their share:
every resource is capped per instance, and each refusal says what and why."""

from __future__ import annotations

import pytest
import wasmtime
from wat_modules import score_input, wat_source

from epick.runtime import Limits, PolicyLoadError, Runtime

SCORE = '(func (export "score") (param i32 i32 i32) (result i32) (i32.const 0))'


def module(*, extra: str = "", score: str = SCORE, memory: str | None = None) -> bytes:
    source = wat_source("minimal", abi_version=1, score=score, extra=extra)
    if memory is not None:
        source = source.replace('(memory (export "memory") 1)', memory)
    return wasmtime.wat2wasm(source)


@pytest.fixture
def rt():
    with Runtime(Limits(budget_ms=1000.0)) as runtime:
        yield runtime


def refusal(rt: Runtime, wasm: bytes, *, instantiate: bool = False) -> str:
    with pytest.raises(PolicyLoadError) as err:
        mod = rt.compile(wasm, name="hostile")
        if instantiate:
            mod.instantiate()
    return str(err.value)


def test_a_second_memory_is_refused_so_the_memory_cap_is_a_total(rt):
    extra = "".join(f"(memory {960})" for _ in range(8))  # 8 x 60 MiB
    assert refusal(rt, module(extra=extra)) == (
        "policy 'hostile': module defines 9 memories; a policy has exactly one"
    )


def test_table_grow_past_the_element_cap_fails_without_allocating(rt):
    # score = 1.0 if table.grow of 25 M entries succeeded, 0.0 if it returned -1
    score = " ".join("""(table $t 1 funcref)
      (func (export "score") (param i32 i32 i32) (result i32)
        (f64.store (local.get 2)
          (select (f64.const 0) (f64.const 1)
                  (i32.eq (table.grow $t (ref.null func) (i32.const 25000000)) (i32.const -1))))
        (i32.const 0))""".split())  # one line: minimal.wat names {{score}} in a comment
    inst = rt.compile(module(score=score), name="grower").instantiate()
    assert inst.score(score_input(1), 1).tolist() == [0.0]


def test_a_table_declared_over_the_element_cap_cannot_instantiate(rt):
    message = refusal(rt, module(extra="(table 1000000 funcref)"), instantiate=True)
    assert message.startswith("policy 'hostile': cannot instantiate: ")
    assert "table" in message


def test_more_tables_than_the_cap_are_refused_before_compiling(rt):
    extra = "".join("(table 1 funcref)" for _ in range(5))
    assert refusal(rt, module(extra=extra)) == (
        "policy 'hostile': module defines 5 tables, over the cap of 4"
    )


def test_a_module_over_the_function_cap_is_refused_before_compiling(rt):
    extra = "(func)" * 10_001
    assert refusal(rt, module(extra=extra)) == (
        "policy 'hostile': module defines 10,007 functions, over the cap of 10,000"
    )


def test_a_module_over_the_size_cap_is_refused_before_compiling():
    with Runtime(Limits(module_bytes=1024)) as small:
        wasm = module(extra='(data (i32.const 0) "' + "x" * 2000 + '")')
        assert refusal(small, wasm) == (
            f"policy 'hostile': module is {len(wasm):,} bytes, over the 1,024-byte cap"
        )


def test_a_module_over_the_globals_cap_is_refused():
    with Runtime(Limits(globals=3)) as small:
        extra = "".join(f"(global i32 (i32.const {k}))" for k in range(4))
        assert refusal(small, module(extra=extra)) == (
            "policy 'hostile': module defines 4 globals, over the cap of 3"
        )


def test_a_start_function_that_never_returns_is_refused_plainly(rt):
    extra = "(func $start (loop $l (br $l))) (start $start)"
    assert refusal(rt, module(extra=extra)) == (
        "policy 'hostile': cannot instantiate: its start function ran out of fuel "
        "(its budget is 1,000,000,000 instructions)"
    )


def test_a_start_function_that_traps_is_refused_plainly(rt):
    extra = "(func $start unreachable) (start $start)"
    assert refusal(rt, module(extra=extra)) == (
        "policy 'hostile': cannot instantiate: its start function trapped: "
        "wasm trap: wasm `unreachable` instruction executed"
    )


def test_a_memory_declared_over_the_cap_cannot_instantiate():
    with Runtime(Limits(memory_bytes=1 << 20)) as small:
        message = refusal(small, module(memory='(memory (export "memory") 32)'))
    assert message.startswith("policy 'hostile': cannot instantiate: ")


def test_a_binary_whose_sections_overrun_the_file_is_refused_with_the_offset(rt):
    wasm = module()
    assert refusal(rt, wasm[:-3]).startswith("policy 'hostile': invalid WebAssembly: section ")
