"""The ABI's export table and the load-time check of a module against it.

A module is checked once, when it is compiled, so no call ever needs a type check:
every export the ABI names must have exactly the signature below, the required ones
must exist, ``score`` or ``filter`` must exist, and the module must import nothing.
Exports the ABI does not name (``__heap_base``, debugging helpers…) are allowed.
"""

from __future__ import annotations

import wasmtime

from epick.runtime.errors import PolicyLoadError

__all__ = ["SIGNATURES", "REQUIRED", "check_exports", "format_signature"]

_I = "i32"

#: export name -> (params, results) of every function the ABI defines (policies/ABI.md).
SIGNATURES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "epick_abi_version": ((), (_I,)),
    "alloc": ((_I,), (_I,)),
    "error_ptr": ((), (_I,)),
    "error_len": ((), (_I,)),
    "init": ((_I, _I), (_I,)),
    "score": ((_I, _I, _I), (_I,)),
    "filter": ((_I, _I, _I), (_I,)),
    "set_snapshot": ((_I, _I), (_I,)),
    "pre_request": ((_I, _I), (_I,)),
    "post_response": ((_I, _I), (_I,)),
    "describe": ((), (_I,)),
    "export_state": ((), (_I,)),
    "import_state": ((_I, _I), (_I,)),
    "output_ptr": ((), (_I,)),
    "output_len": ((), (_I,)),
}

#: Functions every policy exports (plus ``memory``, and ``score`` or ``filter``).
REQUIRED = ("epick_abi_version", "alloc", "error_ptr", "error_len", "init")


def format_signature(params: tuple[str, ...], results: tuple[str, ...]) -> str:
    """``(i32, i32) -> i32``; several or no results in parentheses: ``() -> ()``."""
    res = results[0] if len(results) == 1 else f"({', '.join(results)})"
    return f"({', '.join(params)}) -> {res}"


def _kind(ty: object) -> str:
    return {
        wasmtime.FuncType: "a function",
        wasmtime.MemoryType: "a memory",
        wasmtime.GlobalType: "a global",
        wasmtime.TableType: "a table",
    }.get(type(ty), type(ty).__name__)


def _edits(a: str, b: str) -> int:
    """Edit distance, a swap of neighbours counting one (``scroe`` is 1 from ``score``)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


def check_exports(name: str, module: wasmtime.Module) -> frozenset[str]:
    """Check ``module`` against the ABI's export table; return all its export names.

    Raises :class:`PolicyLoadError` naming the module and the first problem found.
    """
    imports = [f"{i.module}.{i.name}" for i in module.imports]
    if imports:
        raise PolicyLoadError(
            name, None, f"imports {', '.join(repr(i) for i in imports)}; a policy must import nothing"
        )
    types = {e.name: e.type for e in module.exports}

    memory = types.get("memory")
    if memory is None:
        raise PolicyLoadError(name, "memory", "missing export 'memory'")
    if not isinstance(memory, wasmtime.MemoryType):
        raise PolicyLoadError(name, "memory", f"export 'memory' is {_kind(memory)}, expected a memory")
    if memory.is_64 or memory.is_shared:
        raise PolicyLoadError(
            name, "memory", "export 'memory' must be a 32-bit, non-shared memory"
        )

    for export in REQUIRED:
        if export not in types:
            raise PolicyLoadError(name, export, f"missing export {export!r}")
    if "score" not in types and "filter" not in types:
        # Name what it does export, and the export that was likely meant ("scroe").
        near = [f"did you mean {want!r}, not {have!r}?" for have in sorted(types)
                if have not in SIGNATURES for want in ("score", "filter")
                if _edits(have.lower(), want) <= 2]
        raise PolicyLoadError(
            name, None,
            f"missing export 'score' or 'filter'{': ' + ' '.join(near) if near else ''} "
            f"(its exports: {', '.join(sorted(types))})",
        )

    for export, (params, results) in SIGNATURES.items():
        ty = types.get(export)
        if ty is None:
            continue
        if not isinstance(ty, wasmtime.FuncType):
            raise PolicyLoadError(name, export, f"export {export!r} is {_kind(ty)}, expected a function")
        got = (tuple(str(p) for p in ty.params), tuple(str(r) for r in ty.results))
        if got != (params, results):
            raise PolicyLoadError(
                name,
                export,
                f"export {export!r} has signature {format_signature(*got)}, "
                f"expected {format_signature(params, results)}",
            )

    for producer in ("describe", "export_state"):
        if producer in types:
            for needed in ("output_ptr", "output_len"):
                if needed not in types:
                    raise PolicyLoadError(
                        name, needed, f"missing export {needed!r} (required with {producer!r})"
                    )
    return frozenset(types)
