"""The fast path into a guest: ctypes calls to ``wasmtime_func_call_unchecked``.

wasmtime-py's ``Func.__call__`` costs 7-25 µs (it re-reads the function type and boxes
every value); a call here costs about 1 µs. Each :class:`GuestFunc` pre-binds the
store context, the function and a ``wasmtime_val_raw_t`` argument/result buffer, so a
call writes its i32 arguments into that buffer, refills the Store's fuel (the call's
instruction budget), sets the epoch deadline (its wall-clock backstop) and calls.

The call goes through a ``CFUNCTYPE`` pointer, so ctypes releases the GIL for its
duration: that is what lets the epoch ticker thread run and interrupt a spinning guest
(through a ``PYFUNCTYPE``/``PyDLL`` handle the guest would spin forever).

Memory: :class:`GuestMemory` hands out numpy views over the guest's linear memory. The
Engine is built with ``memory_may_move = False`` so a memory's base address never
changes for the instance's lifetime; a view over a region the guest gave us stays valid
however the memory grows (memory never shrinks). Views are bounds-checked when made.

No type checks happen per call: :mod:`epick.runtime.exports` verified every signature
when the module was compiled.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable

import numpy as np
import wasmtime
from wasmtime import _ffi as ffi

from epick.runtime.errors import PolicyOutOfFuel, PolicyTimeout, PolicyTrap

__all__ = ["GuestFunc", "GuestMemory", "trap_reason", "fuel_left", "set_fuel"]

_vp, _u64, _size = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
# CFUNCTYPE: the GIL is released during the call (required, see module docstring).
_call_unchecked = ctypes.CFUNCTYPE(_vp, _vp, _vp, _vp, _size, _vp)(
    ("wasmtime_func_call_unchecked", ffi.dll)
)
# These two never block: keep the GIL (cheaper than dropping and re-taking it).
_set_deadline = ctypes.PYFUNCTYPE(None, _vp, _u64)(("wasmtime_context_set_epoch_deadline", ffi.dll))
# Returns an error pointer, non-NULL only when the engine does not consume fuel (never
# here: Runtime always turns fuel on), so the hot path ignores it.
_set_fuel = ctypes.PYFUNCTYPE(_vp, _vp, _u64)(("wasmtime_context_set_fuel", ffi.dll))
_get_fuel = ctypes.PYFUNCTYPE(_vp, _vp, ctypes.POINTER(_u64))(("wasmtime_context_get_fuel", ffi.dll))
_memory_size = ctypes.PYFUNCTYPE(_size, _vp, _vp)(("wasmtime_memory_data_size", ffi.dll))
_memory_data = ctypes.PYFUNCTYPE(_vp, _vp, _vp)(("wasmtime_memory_data", ffi.dll))

#: Bumped whenever a GuestFunc's budget or an instance's buffers change: the native loop
#: (epick.runtime.scoreall) re-reads what it keeps of them when this moved.
LAYOUT = [0]

_VAL_SIZE = ctypes.sizeof(ffi.wasmtime_val_raw_t)  # 16: a union up to v128
_I32_STRIDE = _VAL_SIZE // 4


def context_address(store: wasmtime.Store) -> int:
    return ctypes.cast(store._context(), ctypes.c_void_p).value  # type: ignore[return-value]


def set_fuel(store: wasmtime.Store, fuel: int) -> None:
    """Give ``store`` exactly ``fuel`` units (0 is fine: its next call traps at once)."""
    _set_fuel(context_address(store), fuel)


def fuel_left(ctx: int) -> int | None:
    """Fuel left in the Store at context address ``ctx``; ``None`` when fuel is off."""
    left = _u64(0)
    if _get_fuel(ctx, ctypes.byref(left)):
        return None
    return left.value


def trap_reason(message: str) -> str:
    """The one line of a wasmtime trap message that says why (not the backtrace)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if "Caused by:" not in lines or lines[-1] == "Caused by:":
        return lines[0] if lines else "trap"
    # An anyhow chain, outermost context first: "0: memory fault at …", "1: wasm trap: …".
    causes = [re.sub(r"^\d+: ", "", line) for line in lines[lines.index("Caused by:") + 1 :]]
    root, context = causes[-1], causes[:-1]
    return f"{root} ({'; '.join(context)})" if context else root


class GuestFunc:
    """One exported ``(i32...) -> i32`` function of one instance, called the fast way.

    ``policy``/``export`` name it in errors; ``fuel`` is its instruction budget (``0``:
    fuel is off in this engine); ``budget_ms``/``ticks`` is its epoch deadline;
    ``on_trap`` may add context to a trap's message (e.g. "memory at its cap").
    Not thread-safe: the owning :class:`~epick.runtime.PolicyInstance` serialises calls.
    """

    __slots__ = (
        "policy", "export", "budget_ms", "_ticks", "_fuel", "on_trap",
        "_func", "_ctx", "_fptr", "_args", "_aptr", "_nargs", "_v", "_trap", "_tptr",
        "_c_ctx", "_c_fuel", "_c_ticks", "_c_fptr", "_c_aptr", "_c_nargs", "_c_tptr",
    )

    def __init__(
        self,
        store: wasmtime.Store,
        func: wasmtime.Func,
        nparams: int,
        *,
        policy: str,
        export: str,
        budget_ms: float,
        ticks: int,
        fuel: int = 0,
        on_trap: Callable[[], str] | None = None,
    ) -> None:
        self.policy, self.export, self.budget_ms = policy, export, budget_ms
        self.on_trap = on_trap
        self._func = func  # keeps the wasmtime_func_t struct we point at alive
        self._ctx = context_address(store)
        self._fptr = ctypes.addressof(func._func)
        self._nargs = max(nparams, 1)
        self._args = (ffi.wasmtime_val_raw_t * self._nargs)()
        self._aptr = ctypes.addressof(self._args)
        # An i32 view of the raw slots: argument k is element k * _I32_STRIDE, and the
        # i32 result comes back in element 0.
        self._v = memoryview(self._args).cast("B").cast("i")
        self._trap = ctypes.c_void_p(0)
        self._tptr = ctypes.addressof(self._trap)
        # Every argument of the three foreign calls, as the ctypes object the call would
        # otherwise build from a Python int each time (~0.7 µs of a ~2 µs crossing).
        self._c_ctx = _vp(self._ctx)
        self.fuel = fuel
        self.ticks = ticks
        self._c_fptr = _vp(self._fptr)
        self._c_aptr = _vp(self._aptr)
        self._c_nargs = _size(self._nargs)
        self._c_tptr = _vp(self._tptr)

    @property
    def fuel(self) -> int:
        """The instruction budget each call starts with (0: fuel is off)."""
        return self._fuel

    @fuel.setter
    def fuel(self, fuel: int) -> None:
        self._fuel, self._c_fuel = fuel, _u64(fuel)
        LAYOUT[0] += 1

    @property
    def ticks(self) -> int:
        """The epoch deadline each call starts with, in ticks from now."""
        return self._ticks

    @ticks.setter
    def ticks(self, ticks: int) -> None:
        self._ticks, self._c_ticks = ticks, _u64(ticks)
        LAYOUT[0] += 1

    def call0(self) -> int:
        ctx = self._c_ctx
        if self._fuel:
            _set_fuel(ctx, self._c_fuel)
        _set_deadline(ctx, self._c_ticks)
        err = _call_unchecked(ctx, self._c_fptr, self._c_aptr, self._c_nargs, self._c_tptr)
        if err or self._trap.value:
            self._raise(err)
        return self._v[0]

    def call1(self, a: int) -> int:
        v = self._v
        v[0] = a
        ctx = self._c_ctx
        if self._fuel:
            _set_fuel(ctx, self._c_fuel)
        _set_deadline(ctx, self._c_ticks)
        err = _call_unchecked(ctx, self._c_fptr, self._c_aptr, self._c_nargs, self._c_tptr)
        if err or self._trap.value:
            self._raise(err)
        return v[0]

    def call2(self, a: int, b: int) -> int:
        v = self._v
        v[0] = a
        v[_I32_STRIDE] = b
        ctx = self._c_ctx
        if self._fuel:
            _set_fuel(ctx, self._c_fuel)
        _set_deadline(ctx, self._c_ticks)
        err = _call_unchecked(ctx, self._c_fptr, self._c_aptr, self._c_nargs, self._c_tptr)
        if err or self._trap.value:
            self._raise(err)
        return v[0]

    def call3(self, a: int, b: int, c: int) -> int:
        v = self._v
        v[0] = a
        v[_I32_STRIDE] = b
        v[2 * _I32_STRIDE] = c
        ctx = self._c_ctx
        if self._fuel:
            _set_fuel(ctx, self._c_fuel)
        _set_deadline(ctx, self._c_ticks)
        err = _call_unchecked(ctx, self._c_fptr, self._c_aptr, self._c_nargs, self._c_tptr)
        if err or self._trap.value:
            self._raise(err)
        return v[0]

    def fuel_used(self) -> int | None:
        """Fuel the last call of this function used (``None`` when fuel is off)."""
        if not self.fuel:
            return None
        left = fuel_left(self._ctx)
        return None if left is None else self.fuel - left

    def _raise(self, err: int | None) -> None:
        """Turn the trap or error the last call left behind into a PolicyError (and free it)."""
        trap_ptr, self._trap.value = self._trap.value, 0
        if trap_ptr:
            trap = wasmtime.Trap._from_ptr(ctypes.cast(trap_ptr, ctypes.POINTER(ffi.wasm_trap_t)))
            code = trap.trap_code
            if code is wasmtime.TrapCode.INTERRUPT:
                raise PolicyTimeout(self.policy, self.export, self.budget_ms)
            if code is wasmtime.TrapCode.OUT_OF_FUEL:
                raise PolicyOutOfFuel(self.policy, self.export, self.fuel)
            text = trap_reason(trap.message)
            code_name = code.name if code is not None else None
        else:
            # wasmtime refused or aborted the call without a trap object.
            error = wasmtime.WasmtimeError._from_ptr(
                ctypes.cast(err, ctypes.POINTER(ffi.wasmtime_error_t))
            )
            text, code_name = trap_reason(str(error)), None
        extra = self.on_trap() if self.on_trap is not None else ""
        raise PolicyTrap(self.policy, self.export, code_name, f"{self.export} trapped: {text}{extra}")


class GuestMemory:
    """Bounds-checked numpy views over one instance's exported linear memory."""

    __slots__ = ("_ctx", "_mem", "_memory", "base")

    def __init__(self, store: wasmtime.Store, memory: wasmtime.Memory) -> None:
        self._memory = memory  # keeps the wasmtime_memory_t struct alive
        self._ctx = context_address(store)
        self._mem = ctypes.addressof(memory._memory)
        self.base: int = _memory_data(self._ctx, self._mem)

    @property
    def size(self) -> int:
        """Current size in bytes (grows, never shrinks)."""
        return _memory_size(self._ctx, self._mem)

    def contains(self, ptr: int, nbytes: int) -> bool:
        return 0 <= ptr and nbytes >= 0 and ptr + nbytes <= self.size

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        """A writable uint8 view of ``[ptr, ptr + nbytes)``; ``IndexError`` if outside."""
        if not self.contains(ptr, nbytes):
            raise IndexError(f"[{ptr}, {ptr + nbytes}) is outside the guest's {self.size} bytes")
        if _memory_data(self._ctx, self._mem) != self.base:  # cannot happen: memory_may_move=False
            raise RuntimeError("guest memory moved although the engine forbids it")
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        buf = (ctypes.c_uint8 * nbytes).from_address(self.base + ptr)
        return np.frombuffer(buf, dtype=np.uint8)

    def read(self, ptr: int, nbytes: int) -> bytes:
        """A copy of ``[ptr, ptr + nbytes)``; ``IndexError`` if outside."""
        return self.view(ptr, nbytes).tobytes()
