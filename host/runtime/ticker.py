"""The epoch ticker: one thread that advances an Engine's epoch every ``period_s``.

Every policy call sets its Store's epoch deadline a few ticks ahead; when the ticker
crosses it, wasmtime traps the guest with ``INTERRUPT`` (the host reports a
``PolicyTimeout``). This only works because guest calls go through a ``CDLL`` function
pointer, which releases the GIL: a guest spinning with the GIL held would starve this
thread and never be interrupted.

Resource handling: the thread is started by :meth:`EpochTicker.start` and stopped and
joined by :meth:`EpochTicker.close` (idempotent). It is a non-daemon thread; so that a
forgotten ``close()`` cannot hang interpreter exit, it is also stopped by the hook that
``threading`` runs before joining non-daemon threads.
"""

from __future__ import annotations

import ctypes
import threading
import time

import wasmtime
from wasmtime import _ffi as ffi

__all__ = ["EpochTicker"]

# PYFUNCTYPE keeps the GIL: incrementing an atomic counter never blocks, and dropping and
# re-taking the GIL around it would cost more than the call.
_increment_epoch = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)(
    ("wasmtime_engine_increment_epoch", ffi.dll)
)


class EpochTicker:
    """Advances ``engine``'s epoch every ``period_s`` seconds on its own thread."""

    def __init__(self, engine: wasmtime.Engine, period_s: float) -> None:
        if not period_s > 0:
            raise ValueError(f"EpochTicker period_s must be > 0, got {period_s!r}")
        self.period_s = period_s
        self._engine = engine  # keeps the engine alive while the thread uses its pointer
        self._engine_ptr = ctypes.cast(engine.ptr(), ctypes.c_void_p).value
        self._running = False
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._running

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("EpochTicker already started")
        self._running = True
        self._thread = threading.Thread(target=self._run, name="epick-epoch-ticker")
        self._thread.start()
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            # Runs before threading joins non-daemon threads at interpreter exit.
            register(self._stop)

    def _run(self) -> None:
        sleep, now, inc = time.sleep, time.monotonic, _increment_epoch
        ptr, period = self._engine_ptr, self.period_s
        # Tick on an absolute schedule so sleep overshoot does not add up; after a stall
        # (a suspended process) skip the missed ticks instead of bursting them.
        due = now() + period
        while self._running:
            delay = due - now()
            if delay > 0:
                sleep(delay)
            inc(ptr)
            due += period
            if due < now() - period:
                due = now() + period

    def _stop(self) -> None:
        self._running = False

    def close(self) -> None:
        """Stop the thread and wait for it (at most one period). Idempotent."""
        self._running = False
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
