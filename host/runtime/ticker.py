"""The epoch ticker: one thread that advances an Engine's epoch every ``period_s``.

Every policy call sets its Store's epoch deadline a few ticks ahead (two consecutive
ticks are at least ``period_s`` apart); when the ticker crosses it, wasmtime traps the
guest with ``INTERRUPT`` (the host reports a ``PolicyTimeout``). This only works because
guest calls go through a ``CFUNCTYPE`` pointer, which releases the GIL: a guest spinning
with the GIL held would starve this thread and never be interrupted.

Resource handling: :meth:`EpochTicker.start` starts the thread; :meth:`EpochTicker.close`
stops and joins it (idempotent). It is a non-daemon thread, and it is also stopped when
the ticker is garbage-collected and by the hook ``threading`` runs before joining
non-daemon threads at interpreter exit — a forgotten ``close()`` neither leaks the
thread for ever nor hangs exit.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import wasmtime
from wasmtime import _ffi as ffi

__all__ = ["EpochTicker"]

# PYFUNCTYPE keeps the GIL: incrementing an atomic counter never blocks, and dropping and
# re-taking the GIL around it would cost more than the call.
_increment_epoch = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)(
    ("wasmtime_engine_increment_epoch", ffi.dll)
)


class _Flag:
    """``running``, plus ``gate``: a lock held while running, released to stop the thread.

    The thread waits on the gate with a timeout instead of sleeping, so stopping is
    immediate; a timed lock wait costs the same as ``time.sleep`` (an Event does not).
    """

    __slots__ = ("running", "gate")

    def __init__(self) -> None:
        self.running = False
        self.gate = threading.Lock()


def _stop(flag: _Flag) -> None:
    if flag.running:
        flag.running = False
        try:
            flag.gate.release()
        except RuntimeError:  # two stoppers raced; the gate is open either way
            pass


def _tick(flag: _Flag, engine: wasmtime.Engine, period: float) -> None:
    # ``engine`` is held so its pointer stays valid while this thread uses it. A relative
    # wait, never a catch-up schedule: two ticks are always at least one period apart,
    # so a deadline of k ticks never fires before (k - 1) periods, even when this thread
    # was kept waiting for the GIL.
    ptr = ctypes.cast(engine.ptr(), ctypes.c_void_p).value
    wait, inc = flag.gate.acquire, _increment_epoch
    while not wait(timeout=period):
        inc(ptr)


class EpochTicker:
    """Advances ``engine``'s epoch every ``period_s`` seconds on its own thread."""

    def __init__(self, engine: wasmtime.Engine, period_s: float) -> None:
        if not period_s > 0:
            raise ValueError(f"EpochTicker period_s must be > 0, got {period_s!r}")
        self.period_s = period_s
        self._engine = engine
        self._flag = _Flag()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._flag.running

    @property
    def flag(self) -> _Flag:
        """The object whose ``running`` attribute :attr:`running` reads: a caller that
        checks on every call keeps it and reads the attribute (no property call)."""
        return self._flag

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("EpochTicker already started")
        flag = self._flag
        flag.gate.acquire()
        flag.running = True
        self._thread = threading.Thread(
            target=_tick, args=(flag, self._engine, self.period_s), name="epick-epoch-ticker"
        )
        self._thread.start()
        weakref.finalize(self, _stop, flag)
        register = getattr(threading, "_register_atexit", None)
        if register is not None:  # runs before threading joins non-daemon threads
            register(_stop, flag)

    def close(self) -> None:
        """Stop the thread and wait for it. Idempotent."""
        _stop(self._flag)
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
