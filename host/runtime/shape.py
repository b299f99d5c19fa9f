"""What a wasm binary declares, read from its section headers before anything compiles it.

Compiling costs time and memory in proportion to the code (a 2.3 MiB module of 200 k
functions took 5–36 s and 1 GiB), and wasmtime cannot interrupt a compile. So the host
reads the counts it caps — functions, globals, tables, memories, data and element
segments — straight from the binary (a few µs, no allocation per entry) and refuses an
oversized module before :class:`wasmtime.Module` ever sees it.

Only the vector counts at the start of each section are read; wasmtime validates the
rest when it compiles. A binary too malformed to scan is refused here with the offset.
"""

from __future__ import annotations

import msgspec

__all__ = ["ModuleShape", "ShapeError", "scan"]

_MAGIC = b"\0asm\x01\0\0\0"
# section id -> ModuleShape field holding that section's vector count
_COUNTED = {2: "imports", 3: "functions", 4: "tables", 5: "memories", 6: "globals",
            9: "elements", 11: "data_segments"}


class ShapeError(ValueError):
    """The bytes are not a wasm binary whose sections can be walked."""


class ModuleShape(msgspec.Struct, frozen=True, kw_only=True):
    """Counts a module declares (its own definitions; imports counted apart)."""

    size: int
    imports: int = 0
    functions: int = 0
    tables: int = 0
    memories: int = 0
    globals: int = 0
    elements: int = 0
    data_segments: int = 0
    code_bytes: int = 0
    has_start: bool = False


def _leb_u32(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    for _ in range(5):
        if pos >= len(data):
            raise ShapeError(f"truncated LEB128 at byte {pos}")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
    raise ShapeError(f"LEB128 longer than 5 bytes at byte {pos}")


def scan(wasm: bytes) -> ModuleShape:
    """The :class:`ModuleShape` of ``wasm``; :class:`ShapeError` if it cannot be walked."""
    if not wasm.startswith(_MAGIC):
        raise ShapeError(f"not a wasm 1.0 binary (starts with {bytes(wasm[:8])!r})")
    counts: dict[str, int] = {}
    has_start = False
    pos = len(_MAGIC)
    end = len(wasm)
    while pos < end:
        section, pos = wasm[pos], pos + 1
        size, pos = _leb_u32(wasm, pos)
        if pos + size > end:
            raise ShapeError(
                f"section {section} at byte {pos} claims {size} bytes, only {end - pos} left"
            )
        field = _COUNTED.get(section)
        if field is not None:
            counts[field] = _leb_u32(wasm, pos)[0]
        elif section == 10:
            counts["code_bytes"] = size
        elif section == 8:
            has_start = True
        pos += size
    return ModuleShape(size=len(wasm), has_start=has_start, **counts)
