"""The Runtime: one wasmtime Engine, its epoch ticker, and compilation of policy modules."""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import dataclasses
import hashlib
import importlib.metadata
import math
import threading
from collections import OrderedDict
from pathlib import Path

import wasmtime

from epick import abi
from epick.runtime._guest import GuestFunc, set_fuel
from epick.runtime.cache import ArtifactCache
from epick.runtime.errors import PolicyError, PolicyLoadError
from epick.runtime.exports import check_exports
from epick.runtime.instance import first_line, instantiate_error
from epick.runtime.limits import Limits
from epick.runtime.module import PolicyModule
from epick.runtime.shape import ShapeError, scan
from epick.runtime.ticker import EpochTicker

__all__ = ["Runtime", "instantiate_error", "trim_heap"]

_WASM_MAGIC = b"\0asm"
# Every Config setting below, in one place, so the artifact cache key covers them all.
_ENGINE_SETTINGS = {
    "epoch_interruption": True,
    "consume_fuel": True,
    # A memory's base address never moves, so cached views over guest memory stay valid.
    "memory_may_move": False,
    "cranelift_opt_level": "speed",
    # One memory per policy, so the memory cap is a cap on all of its linear memory.
    "wasm_multi_memory": False,
    # A compile cannot be interrupted: on one thread it leaves the other core to picks.
    "parallel_compilation": False,
}
#: Compiled modules kept in memory (content-addressed). Only vetted modules get in.
MEMORY_CACHE_MODULES = 16


def trim_heap() -> None:
    """Hand freed heap back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    A big compile that is then refused frees its memory, but glibc keeps it in its
    arenas: a refused 2.3 MiB module left the process 1 GiB larger. Called after a
    refusal, so refused means forgotten in RSS too."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


class Runtime:
    """Owns the wasmtime Engine (fuel and epoch interruption on) and ONE epoch ticker thread.

    ``limits`` apply to every instance made from modules this runtime compiles.
    ``cache_dir`` (optional) keeps compiled artifacts across restarts, keyed by the
    wasm's sha256 (see :mod:`epick.runtime.cache`); modules are also cached in memory.

    Resource handling: the ticker starts here and stops in :meth:`close` (or at the end
    of a ``with`` block). Instances of a closed runtime refuse calls with
    ``RuntimeError``, because nothing could interrupt a runaway guest any more.

    Every call gets ``Limits.fuel`` (x100 for control-plane calls): the deterministic
    limit. The epoch deadline is the wall-clock backstop. The ticker period is
    ``budget_ms`` (clamped to [0.5, 100] ms); a call's deadline is
    ``ceil(budget / period) + 1`` ticks away, so a call is stopped after between
    ``budget`` and ``budget + period`` plus wake-up lateness. Each tick wakes a thread
    (~15-20 µs of CPU here): at the default 50 ms that is ~0.04% of a core (at 1 ms, 2%).
    """

    def __init__(self, limits: Limits = Limits(), cache_dir: Path | None = None, *,
                 fuel: bool = True, epoch: bool = True) -> None:
        if not isinstance(limits, Limits):
            raise TypeError(f"Runtime limits must be a Limits, got {type(limits).__name__}")
        self.limits = limits
        # fuel=False / epoch=False exist to measure what each costs (epick.bench); the service
        # always runs with both.
        settings = {**_ENGINE_SETTINGS, "consume_fuel": fuel, "epoch_interruption": epoch}
        self.fuel = fuel
        config = wasmtime.Config()
        for key, value in settings.items():
            setattr(config, key, value)
        self.engine = wasmtime.Engine(config)
        self.tick_ms = min(max(limits.budget_ms, 0.5), 100.0)
        fingerprint = f"wasmtime {importlib.metadata.version('wasmtime')} {sorted(settings.items())}"
        self._cache = ArtifactCache(Path(cache_dir), fingerprint) if cache_dir is not None else None
        self._modules: OrderedDict[str, wasmtime.Module] = OrderedDict()
        self._lock = threading.Lock()  # compile() may run on worker threads
        self._rebuilder: concurrent.futures.ThreadPoolExecutor | None = None
        self.ticker = EpochTicker(self.engine, self.tick_ms / 1000)
        self.ticker.start()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the epoch ticker and the rebuild thread. Idempotent."""
        self.ticker.close()
        with self._lock:
            rebuilder, self._rebuilder = self._rebuilder, None
        if rebuilder is not None:
            rebuilder.shutdown(wait=True, cancel_futures=True)

    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the runtime's rebuild thread (one, started on first use,
        stopped by :meth:`close`): where ``WasmPolicy`` re-creates instances, off the
        pick path."""
        self._check_open()
        with self._lock:
            if self._rebuilder is None:
                self._rebuilder = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="epick-rebuild")
            return self._rebuilder.submit(fn, *args)

    @property
    def closed(self) -> bool:
        return not self.ticker.running

    def ticks_for(self, budget_ms: float) -> int:
        """The epoch deadline, in ticks, that stops a call after at least ``budget_ms``."""
        return math.ceil(budget_ms / self.tick_ms) + 1

    def fuel_for(self, fuel: int) -> int:
        """``fuel`` when this engine consumes fuel, else 0 (GuestFunc's "off")."""
        return fuel if self.fuel else 0

    def new_store(self, *, backstop_ms: float) -> wasmtime.Store:
        """A Store with every per-instance cap set, its fuel at the control budget (for a
        start function) and its epoch deadline ``backstop_ms`` away."""
        lim = self.limits
        store = wasmtime.Store(self.engine)
        store.set_limits(memory_size=lim.memory_bytes, table_elements=lim.table_elements,
                         instances=1, tables=lim.tables, memories=1)
        if self.fuel:
            set_fuel(store, lim.control_fuel)
        store.set_epoch_deadline(self.ticks_for(backstop_ms))
        return store

    def compile(self, wasm: bytes, *, name: str) -> PolicyModule:
        """Compile (or load from cache) and check a policy module.

        Checks, before compiling: the bytes are wasm, within ``Limits.module_bytes``,
        and define at most ``Limits.functions`` functions and ``Limits.globals``
        globals. After: the module imports nothing, every ABI export has its signature,
        the required ones exist, and ``epick_abi_version()`` returns a version the host
        speaks (:data:`epick.abi.ABI_VERSIONS`; kept as ``abi_version``). Raises :class:`PolicyLoadError` naming ``name``
        and the problem. Safe to call from any thread.

        The compiled module is cached (in memory and in ``cache_dir``) only by
        :meth:`keep`, once the caller accepted it: a refused module leaves nothing behind.
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
        shape = self._check_shape(name, wasm)
        sha256 = hashlib.sha256(wasm).hexdigest()
        module, cached = self._load(wasm, sha256, name)
        exports = check_exports(name, module)
        mod = PolicyModule(
            name=name, sha256=sha256, exports=exports, size=len(wasm), runtime=self,
            _module=module, has_start=shape.has_start, _cached=cached,
        )
        version = self._check_abi_version(mod)
        if version != mod.abi_version:
            mod = dataclasses.replace(mod, abi_version=version)
        return mod

    def _check_shape(self, name: str, wasm: bytes):
        lim = self.limits
        if len(wasm) > lim.module_bytes:
            raise PolicyLoadError(
                name, None, f"module is {len(wasm):,} bytes, over the {lim.module_bytes:,}-byte cap"
            )
        try:
            shape = scan(wasm)
        except ShapeError as exc:
            raise PolicyLoadError(name, None, f"invalid WebAssembly: {exc}") from None
        for what, count, cap in (("functions", shape.functions, lim.functions),
                                 ("globals", shape.globals, lim.globals),
                                 ("tables", shape.tables, lim.tables)):
            if count > cap:
                raise PolicyLoadError(
                    name, None, f"module defines {count:,} {what}, over the cap of {cap:,}"
                )
        if shape.memories > 1:
            raise PolicyLoadError(
                name, None, f"module defines {shape.memories} memories; a policy has exactly one"
            )
        return shape

    def _load(self, wasm: bytes, sha256: str, name: str) -> tuple[wasmtime.Module, bool]:
        """The compiled module, and whether it came from a cache (so was kept before)."""
        with self._lock:
            module = self._modules.get(sha256)
            if module is not None:
                self._modules.move_to_end(sha256)
                return module, True
        module = self._cache.load(self.engine, sha256) if self._cache is not None else None
        if module is not None:
            self._remember(sha256, module)
            return module, True
        try:
            return wasmtime.Module(self.engine, wasm), False
        except wasmtime.WasmtimeError as exc:
            raise PolicyLoadError(name, None, f"invalid WebAssembly: {first_line(exc)}") from exc

    def _remember(self, sha256: str, module: wasmtime.Module) -> None:
        with self._lock:
            self._modules[sha256] = module
            self._modules.move_to_end(sha256)
            while len(self._modules) > MEMORY_CACHE_MODULES:
                self._modules.popitem(last=False)

    def keep(self, mod: PolicyModule) -> None:
        """Cache ``mod``'s compiled code (memory and disk): it was accepted. Idempotent."""
        self._remember(mod.sha256, mod._module)
        if self._cache is not None and not mod._cached:  # freshly compiled: not on disk yet
            self._cache.store(mod.sha256, mod._module)

    def forget(self, sha256: str) -> None:
        """Drop the in-memory copy of a module no policy uses any more (disk stays)."""
        with self._lock:
            self._modules.pop(sha256, None)

    @property
    def cached_modules(self) -> frozenset[str]:
        """sha256 of every module held in memory."""
        with self._lock:
            return frozenset(self._modules)

    def _check_abi_version(self, mod: PolicyModule) -> int:
        """Instantiate once, without ``init``, and ask the module its ABI version."""
        budget = self.limits.control_budget_ms
        store = self.new_store(backstop_ms=budget)
        try:
            instance = wasmtime.Instance(store, mod._module, [])
        except (wasmtime.WasmtimeError, wasmtime.Trap) as exc:
            raise instantiate_error(mod.name, exc, has_start=mod.has_start,
                                    fuel=self.limits.control_fuel, backstop_ms=budget) from exc
        func = GuestFunc(
            store, instance.exports(store)["epick_abi_version"], 0,  # type: ignore[arg-type]
            policy=mod.name, export="epick_abi_version", budget_ms=budget,
            ticks=self.ticks_for(budget), fuel=self.fuel_for(self.limits.control_fuel),
        )
        try:
            version = func.call0()
        except PolicyError as exc:
            raise PolicyLoadError(mod.name, "epick_abi_version", exc.detail) from exc
        if version not in abi.ABI_VERSIONS:
            speaks = " and ".join(str(v) for v in abi.ABI_VERSIONS)
            raise PolicyLoadError(
                mod.name, "epick_abi_version",
                f"ABI version {version}, this host speaks {speaks}",
            )
        return version

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("Runtime is closed")
