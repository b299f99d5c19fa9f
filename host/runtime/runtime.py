"""The Runtime: one wasmtime Engine, its epoch ticker, and compilation of policy modules."""

from __future__ import annotations

import hashlib
import importlib.metadata
import math
import threading
from pathlib import Path

import wasmtime

from epick import abi
from epick.runtime._guest import GuestFunc
from epick.runtime.cache import ArtifactCache
from epick.runtime.errors import PolicyError, PolicyLoadError
from epick.runtime.exports import check_exports
from epick.runtime.limits import Limits
from epick.runtime.module import PolicyModule
from epick.runtime.ticker import EpochTicker

__all__ = ["Runtime"]

_WASM_MAGIC = b"\0asm"
# Every Config setting below, in one place, so the artifact cache key covers them all.
_ENGINE_SETTINGS = {
    "epoch_interruption": True,
    # A memory's base address never moves, so cached views over guest memory stay valid.
    "memory_may_move": False,
    "cranelift_opt_level": "speed",
}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Runtime:
    """Owns the wasmtime Engine (epoch interruption on) and ONE epoch ticker thread.

    ``limits`` apply to every instance made from modules this runtime compiles.
    ``cache_dir`` (optional) keeps compiled artifacts across restarts, keyed by the
    wasm's sha256 (see :mod:`epick.runtime.cache`); modules are also cached in memory.

    Resource handling: the ticker starts here and stops in :meth:`close` (or at the end
    of a ``with`` block). Instances of a closed runtime refuse calls with
    ``RuntimeError``, because nothing could interrupt a runaway guest any more.

    The ticker period is ``budget_ms`` (clamped to [0.5, 100] ms); a call's deadline is
    ``ceil(budget / period) + 1`` ticks away, so a call is stopped after between
    ``budget`` and ``budget + period`` plus wake-up lateness (measured here at the
    default 1 ms budget: a spinning guest is stopped after ~2.2 ms). Each tick wakes a
    thread (~15-20 µs of CPU here), so a finer period costs CPU for every millisecond of
    uptime: at 1 ms it is ~2% of a core.
    """

    def __init__(self, limits: Limits = Limits(), cache_dir: Path | None = None) -> None:
        if not isinstance(limits, Limits):
            raise TypeError(f"Runtime limits must be a Limits, got {type(limits).__name__}")
        self.limits = limits
        config = wasmtime.Config()
        for key, value in _ENGINE_SETTINGS.items():
            setattr(config, key, value)
        self.engine = wasmtime.Engine(config)
        self.tick_ms = min(max(limits.budget_ms, 0.5), 100.0)
        fingerprint = f"wasmtime {importlib.metadata.version('wasmtime')} {sorted(_ENGINE_SETTINGS.items())}"
        self._cache = ArtifactCache(Path(cache_dir), fingerprint) if cache_dir is not None else None
        self._modules: dict[str, wasmtime.Module] = {}
        self._lock = threading.Lock()  # compile() may run on worker threads
        self.ticker = EpochTicker(self.engine, self.tick_ms / 1000)
        self.ticker.start()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the epoch ticker. Idempotent."""
        self.ticker.close()

    @property
    def closed(self) -> bool:
        return not self.ticker.running

    def ticks_for(self, budget_ms: float) -> int:
        """The epoch deadline, in ticks, that stops a call after at least ``budget_ms``."""
        return math.ceil(budget_ms / self.tick_ms) + 1

    def compile(self, wasm: bytes, *, name: str) -> PolicyModule:
        """Compile (or load from cache) and check a policy module.

        Checks: the bytes are wasm, the module imports nothing, every ABI export has its
        signature, the required ones exist, and ``epick_abi_version()`` returns the
        host's :data:`epick.abi.ABI_VERSION`. Raises :class:`PolicyLoadError` naming
        ``name`` and the problem. Safe to call from any thread.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"Runtime.compile: name must be a non-empty str, got {name!r}")
        if not isinstance(wasm, (bytes, bytearray, memoryview)):
            raise TypeError(f"Runtime.compile: wasm must be bytes, got {type(wasm).__name__}")
        self._check_open()
        wasm = bytes(wasm)
        if not wasm.startswith(_WASM_MAGIC):
            raise PolicyLoadError(
                name, None, f"not a WebAssembly module (starts with {wasm[:8]!r}, expected {_WASM_MAGIC!r})"
            )
        sha256 = hashlib.sha256(wasm).hexdigest()
        module = self._load(wasm, sha256, name)
        exports = check_exports(name, module)
        mod = PolicyModule(
            name=name, sha256=sha256, exports=exports, size=len(wasm), runtime=self, _module=module
        )
        self._check_abi_version(mod)
        return mod

    def _load(self, wasm: bytes, sha256: str, name: str) -> wasmtime.Module:
        with self._lock:
            module = self._modules.get(sha256)
        if module is not None:
            return module
        module = self._cache.load(self.engine, sha256) if self._cache is not None else None
        if module is None:
            try:
                module = wasmtime.Module(self.engine, wasm)
            except wasmtime.WasmtimeError as exc:
                raise PolicyLoadError(name, None, f"invalid WebAssembly: {_first_line(exc)}") from exc
            if self._cache is not None:
                self._cache.store(sha256, module)
        with self._lock:
            return self._modules.setdefault(sha256, module)

    def _check_abi_version(self, mod: PolicyModule) -> None:
        """Instantiate once, without ``init``, and ask the module its ABI version."""
        store = wasmtime.Store(self.engine)
        store.set_limits(memory_size=self.limits.memory_bytes)
        budget = self.limits.control_budget_ms
        store.set_epoch_deadline(self.ticks_for(budget))
        try:
            instance = wasmtime.Instance(store, mod._module, [])
        except (wasmtime.WasmtimeError, wasmtime.Trap) as exc:
            raise PolicyLoadError(mod.name, None, f"cannot instantiate: {_first_line(exc)}") from exc
        func = GuestFunc(
            store, instance.exports(store)["epick_abi_version"], 0,  # type: ignore[arg-type]
            policy=mod.name, export="epick_abi_version", budget_ms=budget,
            ticks=self.ticks_for(budget),
        )
        try:
            version = func.call0()
        except PolicyError as exc:
            raise PolicyLoadError(mod.name, "epick_abi_version", exc.detail) from exc
        if version != abi.ABI_VERSION:
            raise PolicyLoadError(
                mod.name, "epick_abi_version",
                f"ABI version {version}, this host speaks {abi.ABI_VERSION}",
            )

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("Runtime is closed")
