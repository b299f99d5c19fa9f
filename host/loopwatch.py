"""The event loop's lag, measured, and a stall named while it happens.

Everything the service does runs on one event-loop thread, so anything that holds it —
a long callback, a blocking call in a coroutine, a thread that keeps the GIL — delays
every pick queued behind it. :class:`LoopWatch` has two parts:

- a task on the loop that asks to wake every ``interval_s`` and reports how late it
  woke (``observe(lag_seconds)``: the service passes ``epick_event_loop_lag_seconds``);
- a watchdog thread that notices when that task has not woken for ``warn_s`` past its
  time and, *while the loop is still held*, samples the loop thread's stack
  (``sys._current_frames``) and the task it runs. When the loop comes back, one warning
  says how long it was held and what ran: the asyncio task's name and the innermost
  frames of the stack outside asyncio's and anyio's own. (asyncio's debug-mode slow-callback log only names
  the Handle, e.g. ``<Task ... Service.run()>``, and costs on every callback.)

Owned by the service's task group: ``await tg.start(watch.run)``; cancelling the task
stops and joins the thread.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import anyio

__all__ = ["LoopWatch", "Stall"]

log = logging.getLogger("epick.loop")

#: How many of the innermost frames of the loop thread's stack a warning shows.
STACK_FRAMES = 6


class Stall:
    """What the watchdog saw on the loop thread while it was held."""

    __slots__ = ("task", "stack")

    def __init__(self, task: str, stack: str) -> None:
        self.task = task
        """The running asyncio task's name, or ``no task`` for a plain callback (a gRPC
        or timer callback)."""
        self.stack = stack
        """The innermost frames outside asyncio and anyio, formatted as a traceback
        (most recent call last)."""


class LoopWatch:
    """Measures the loop's lag (every ``interval_s``) and warns, naming the culprit,
    when the loop is held more than ``warn_s`` (0: measure only, no watchdog)."""

    def __init__(self, *, warn_s: float, observe: Callable[[float], None] = lambda _s: None,
                 on_stall: Callable[[float, Stall | None], None] | None = None,
                 interval_s: float = 0.05) -> None:
        self.warn_s = warn_s
        self.interval_s = interval_s
        self.observe = observe
        self.on_stall = on_stall
        """Called on the loop after a stall past ``warn_s`` with its length and what was
        seen running (the service counts it); the warning is logged either way."""
        self.sampled = threading.Event()
        """Set when the watchdog has sampled a stall (tests wait on it)."""
        self._due = 0.0  # monotonic time the loop task should wake next; 0 = not running
        self._seen: Stall | None = None
        self._seen_for = 0.0  # the ``_due`` the sample in ``_seen`` belongs to
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._stop = threading.Event()

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._due = time.monotonic() + self.interval_s
        watchdog = None
        if self.warn_s > 0:
            watchdog = threading.Thread(target=self._watch, name="epick-loop-watchdog",
                                        daemon=True)
            watchdog.start()
        task_status.started()
        try:
            while True:
                await anyio.sleep(self.interval_s)
                self._woke(time.monotonic())
        finally:
            self._stop.set()
            if watchdog is not None:
                watchdog.join()

    def _woke(self, now: float) -> None:
        due, self._due = self._due, now + self.interval_s
        lag = max(0.0, now - due)
        self.observe(lag)
        if self.warn_s > 0 and lag > self.warn_s:
            seen = self._seen if self._seen_for == due else None
            self._warn(lag, seen)

    def _warn(self, lag: float, seen: Stall | None) -> None:
        if seen is None:  # the watchdog did not get to run while the loop was held
            what = "nothing sampled (the watchdog thread did not run in time)"
        else:
            what = f"running {seen.task}:\n{seen.stack}"
        log.warning("event loop held for %.0f ms (over [server] loop_stall_warn_ms = %g); "
                    "picks waited behind it; %s", lag * 1e3, self.warn_s * 1e3, what)
        if self.on_stall is not None:
            self.on_stall(lag, seen)

    def _watch(self) -> None:
        """The watchdog thread: sample the loop thread once per stall, while it lasts."""
        step = max(0.005, self.warn_s / 4)
        while not self._stop.wait(step):
            due = self._due
            if due and time.monotonic() - due > self.warn_s and self._seen_for != due:
                self._seen = self._sample()
                self._seen_for = due
                self.sampled.set()

    def _sample(self) -> Stall:
        frame = sys._current_frames().get(self._loop_thread)
        frames = [f for f in traceback.extract_stack(frame) if not _plumbing(f.filename)
                  ] if frame is not None else []
        stack = ("".join(traceback.format_list(frames[-STACK_FRAMES:])).rstrip()
                 or "  (no stack)")
        task = asyncio.current_task(self._loop) if self._loop is not None else None
        name = "no task (a callback)" if task is None else f"task {task.get_name()!r}"
        return Stall(name, stack)


_PLUMBING = tuple(str(Path(m.__file__).parent) for m in (asyncio, anyio))


def _plumbing(filename: str) -> bool:
    """A frame of the event loop's own machinery (asyncio, anyio): never the culprit."""
    return filename.startswith(_PLUMBING)
