"""shape.scan: the counts a module declares, read from its section headers, and clear
refusals of bytes that cannot be walked."""

from __future__ import annotations

import pytest
import wasmtime

from epick.runtime.shape import ModuleShape, ShapeError, scan

MAGIC = b"\0asm\x01\0\0\0"


def test_an_empty_module_declares_nothing():
    assert scan(MAGIC) == ModuleShape(size=8)


def test_every_capped_count_is_read():
    wasm = wasmtime.wat2wasm("""
        (module
          (import "env" "f" (func))
          (memory 1)
          (table 2 funcref)
          (global (mut i32) (i32.const 0))
          (global i64 (i64.const 1))
          (func $a) (func $b) (func $c)
          (start $a)
          (elem (i32.const 0) $b)
          (data (i32.const 0) "x")
          (data (i32.const 8) "y"))""")
    shape = scan(wasm)
    assert (shape.size, shape.imports, shape.functions, shape.tables, shape.memories,
            shape.globals, shape.elements, shape.data_segments, shape.has_start) == (
        len(wasm), 1, 3, 1, 1, 2, 1, 2, True)
    assert 0 < shape.code_bytes < len(wasm)


def test_bytes_that_are_not_wasm_are_refused_with_what_they_start_with():
    with pytest.raises(ShapeError) as err:
        scan(b"\x7fELF\x02\x01\x01\x00rest")
    assert str(err.value) == "not a wasm 1.0 binary (starts with b'\\x7fELF\\x02\\x01\\x01\\x00')"


def test_a_section_longer_than_the_bytes_left_is_refused_with_its_offset():
    with pytest.raises(ShapeError) as err:
        scan(MAGIC + b"\x03\x10\x01")  # function section claiming 16 bytes, 1 left
    assert str(err.value) == "section 3 at byte 10 claims 16 bytes, only 1 left"


def test_a_truncated_or_overlong_leb128_is_refused():
    with pytest.raises(ShapeError, match="truncated LEB128 at byte 9"):
        scan(MAGIC + b"\x03")  # a section id and no size
    with pytest.raises(ShapeError, match="LEB128 longer than 5 bytes at byte 14"):
        scan(MAGIC + b"\x03" + b"\x80" * 5 + b"\x00")


def test_a_count_is_read_from_a_multi_byte_leb128():
    # function section: count 300 (0xAC 0x02), bodies not checked here
    body = b"\xac\x02" + b"\x00" * 300
    section = b"\x03" + bytes([0x80 | (len(body) & 0x7F), len(body) >> 7]) + body
    assert scan(MAGIC + section).functions == 300
