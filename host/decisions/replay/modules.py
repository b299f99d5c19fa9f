"""Module lookup for a replay: wasm bytes by sha256 — given, embedded in the log, or a
built-in policy — compiled once each."""

from __future__ import annotations

import time
from typing import Any

from epick.decisions.replay.changes import ReplayError

__all__ = ["Modules"]


class Modules:
    """The modules a replay can run, by sha256; ``runtime`` compiles them."""

    def __init__(self, runtime, given: dict[str, bytes] | None = None) -> None:
        self.runtime = runtime
        self._wasm: dict[str, bytes] = dict(given or {})
        self._compiled: dict[str, Any] = {}
        self._builtins = False
        self.compile_seconds = 0.0
        """Time spent compiling (left out of the replay's own time)."""

    def add(self, sha: str, wasm: bytes) -> None:
        """Known bytes for ``sha`` (the first given wins)."""
        self._wasm.setdefault(sha, wasm)

    def compiled(self, sha: str, name: str):
        """Policy ``name``'s module ``sha`` (sha256 hex), compiled once; :class:`ReplayError`
        when no bytes are known for it or it does not compile."""
        mod = self._compiled.get(sha)
        if mod is not None:
            return mod
        wasm = self._wasm.get(sha)
        if wasm is None and not self._builtins:
            import hashlib

            from epick.config import BUILTIN_POLICY_DIR

            self._builtins = True
            for p in sorted(BUILTIN_POLICY_DIR.glob("*.wasm")):
                data = p.read_bytes()
                self._wasm.setdefault(hashlib.sha256(data).hexdigest(), data)
            wasm = self._wasm.get(sha)
        if wasm is None:
            raise ReplayError(
                f"policy {name!r}: module sha256 {sha[:12]}… is not in the log, nor a "
                f"built-in; give it with --policy {name}=FILE.wasm or --modules DIR")
        from epick.runtime import PolicyError

        t0 = time.perf_counter()
        try:
            mod = self.runtime.compile(wasm, name=name)
        except PolicyError as exc:
            raise ReplayError(f"policy {name!r}: {exc}") from None
        finally:
            self.compile_seconds += time.perf_counter() - t0
        self._compiled[sha] = mod
        return mod
