"""One C call for all of a pick's scorers (docs/performance.md, "Fifth round").

:func:`score_all` is :class:`~epick.runtime.WasmPolicy`'s ``score_group``: the scheduler
hands it every live scorer of a pick when they are all WasmPolicies, and it runs their
``score`` calls in one call into ``libepick_scoreall.so`` (``make native`` builds it
from ``native/epick_scoreall.c``) instead of one Python call stack per policy. The C loop
writes the score frame (and each instance's carried pre_request event) into each guest,
calls each ``score`` with its own fuel and epoch deadline, checks and reads the scores
back, and sums ``weight × score`` in the scorers' order: the same floats the
scheduler's numpy loop makes.

What it does not do, Python does, with the same code as the one-policy path:

- **Before any call**, every scorer must be plainly callable: its breaker closed, its
  instance live, its snapshot delivered (resident policies), its buffers big enough, no
  failure left to report. Otherwise :func:`score_all` returns ``None`` and the scheduler
  runs the per-policy path for this pick (which grows buffers, feeds snapshots, admits
  half-open trials, recovers instances): nothing was called, so nothing differs.
- **After the loop**, a scorer that did not come back clean (a trap, running out of fuel,
  the epoch deadline, a non-zero status, a carried event's failure, a score missing or
  out of range) is finished by :meth:`PolicyInstance.native_score_finish` and
  :meth:`WasmPolicy.native_finish`: the trap is in that function's own trap slot and the
  scores in the guest's output slots, so the same exceptions, breaker outcomes, stats,
  retries and clamping follow as on the Python path; its totals are then summed by the
  scheduler's loop.

Without the library (a wheel installed with pip, no C compiler) or with
``EPICK_SCORE_NATIVE=0`` in the environment, :data:`enabled` is False and every pick takes
the Python path.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from wasmtime import _ffi as ffi

from epick.interfaces import Cycle, PluginError
from epick.runtime import frame as _frames
from epick.runtime._guest import LAYOUT, GuestFunc
from epick.runtime.instance import NATIVE_OK

__all__ = ["score_all", "use_library", "enabled", "available", "LIBRARY"]

#: Where ``make native`` puts the library.
LIBRARY = Path(__file__).with_name("native") / "libepick_scoreall.so"

_vp, _u64 = ctypes.c_void_p, ctypes.c_uint64
_perf_ns = time.perf_counter_ns


class _Fns(ctypes.Structure):
    _fields_ = [("call", _vp), ("set_deadline", _vp), ("set_fuel", _vp), ("mem_data", _vp),
                ("mem_size", _vp)]


class _Func(ctypes.Structure):
    _fields_ = [("func", _vp), ("args", _vp), ("trap", _vp), ("nargs", _u64), ("fuel", _u64),
                ("ticks", _u64)]


class _Scorer(ctypes.Structure):
    _fields_ = [("ctx", _vp), ("mem", _vp), ("plain", _Func), ("carrying", _Func),
                ("in_ptr", _u64), ("in_cap", _u64), ("out_ptr", _u64), ("out_slots", _u64),
                ("frame", _u64), ("event_at", _u64), ("weight", ctypes.c_double)]


def _load(path: Path) -> Any:
    if not path.exists():
        return None
    try:
        lib = ctypes.CDLL(str(path))  # CDLL: the GIL is released for the whole loop
    except OSError:
        return None
    fn = lib.epick_score_all
    fn.restype = ctypes.c_int
    fn.argtypes = [_vp, _vp, ctypes.c_int, ctypes.c_char_p, _u64, ctypes.c_char_p, _u64,
                   ctypes.c_char_p, _vp, _u64, _vp, _vp]
    return fn


def _addr(name: str) -> int:
    return ctypes.cast(getattr(ffi.dll, name), _vp).value  # type: ignore[return-value]


# wasmtime's own functions, from the library wasmtime-py loaded.
_fns = _Fns(call=_addr("wasmtime_func_call_unchecked"),
            set_deadline=_addr("wasmtime_context_set_epoch_deadline"),
            set_fuel=_addr("wasmtime_context_set_fuel"),
            mem_data=_addr("wasmtime_memory_data"),
            mem_size=_addr("wasmtime_memory_data_size"))
_fns_ptr = _vp(ctypes.addressof(_fns))

_call: Any = None
#: The library is loaded (``make native`` built it).
available = False
#: Picks use it (tests and benchmarks turn it off to compare; ``EPICK_SCORE_NATIVE=0``).
enabled = False


def use_library(path: Path | None = LIBRARY) -> bool:
    """Load the native loop from ``path`` (``None``: none; a missing or unloadable file:
    none either), and use it unless ``EPICK_SCORE_NATIVE=0``. Returns :data:`enabled`."""
    global _call, available, enabled
    _call = _load(path) if path is not None else None
    available = _call is not None
    enabled = available and os.environ.get("EPICK_SCORE_NATIVE", "1") != "0"
    _plans.clear()
    return enabled


def _func(dst: _Func, f: GuestFunc | None) -> None:
    if f is None:
        return
    dst.func, dst.args, dst.trap = f._fptr, f._aptr, f._tptr
    dst.nargs, dst.fuel, dst.ticks = f._nargs, f.fuel, f.ticks


class _Plan:
    """What the C loop keeps of one set of scorers and their instances."""

    __slots__ = ("entries", "insts", "layout", "k", "table", "table_ptr", "frames",
                 "any_a", "any_b", "ev_lens", "ev_ptr", "staging", "staging_ptr", "cap",
                 "results", "results_ptr", "live", "resident", "take", "done")

    def __init__(self, entries: tuple, insts: list) -> None:
        from epick.abi import FRAME_EVENT_LEN_AT

        self.entries, self.insts = entries, insts
        self.layout = LAYOUT[0]
        k = self.k = len(entries)
        table = self.table = (_Scorer * k)()
        self.frames = tuple(bool(e.plugin._resident) for e in entries)
        self.any_a, self.any_b = False in self.frames, True in self.frames
        for i, (e, inst) in enumerate(zip(entries, insts)):
            row = table[i]
            row.ctx = inst._memory._ctx
            row.mem = inst._memory._mem
            _func(row.plain, inst._score)
            _func(row.carrying, inst._score_ev)
            row.in_ptr, row.in_cap = inst._in_ptr, inst._in_cap
            row.out_ptr, row.out_slots = inst._out_ptr, inst._out_slots
            row.frame = int(self.frames[i])
            row.event_at = FRAME_EVENT_LEN_AT
            row.weight = float(e.weight)
        self.table_ptr = _vp(ctypes.addressof(table))
        self.ev_lens = (ctypes.c_uint32 * k)()
        self.ev_ptr = _vp(ctypes.addressof(self.ev_lens))
        self.results = np.zeros(3 * k, dtype=np.int64)
        self.results_ptr = _vp(self.results.ctypes.data)
        self.cap = 0
        self.staging = np.empty(0)
        self.staging_ptr = _vp(0)
        # What each pick reads, in loops without attribute chains: whether the plan still
        # holds (each supervisor's live instance, each score breaker closed), whether a
        # resident policy has this view already, what taking an instance touches, and
        # what a clean call's bookkeeping touches.
        self.live = tuple((e.plugin.supervisor, inst, e.plugin._score_breaker)
                          for e, inst in zip(entries, insts))
        self.resident = tuple((e.plugin, inst) for e, inst in zip(entries, insts)
                              if e.plugin._resident)
        self.take = tuple((inst, inst._lock, inst._ticking) for inst in insts)
        self.done = tuple((inst._lock, e.plugin.stats, e.plugin.stats._latency_ns,
                           e.plugin._score_breaker) for e, inst in zip(entries, insts))

    def room(self, n: int) -> None:
        if n > self.cap:
            self.cap = max(n, 2 * self.cap, 64)
            self.staging = np.empty((self.k + 1) * self.cap)
            self.staging_ptr = _vp(self.staging.ctypes.data)


#: Plans by id of the scorers tuple (a policy set's; checked by identity): a few sets
#: alternate (benchmarks, a swap), so each keeps its own.
_plans: dict[int, _Plan] = {}


def _new_plan(entries: tuple) -> _Plan | None:
    """A plan for ``entries`` now (kept), or ``None`` if one of them cannot take the loop
    (or not now: a score breaker not closed)."""
    insts = []
    for e in entries:
        p = e.plugin
        inst = p.supervisor._inst
        if inst is None or not p._v2 or inst._score is None:
            return None
        insts.append(inst)
    if len(_plans) >= 8:
        _plans.clear()
    plan = _plans[id(entries)] = _Plan(entries, insts)
    for _sup, _inst, breaker in plan.live:
        if breaker.state != "closed":
            return None
    return plan


def _release(insts: list, events: list) -> None:
    """Nothing was called after all: give every taken instance (the first
    ``len(events)`` of ``insts``) back as it was."""
    for inst, ev in zip(insts, events):
        if ev is not None:
            inst._pending = ev
        inst._lock.release()


def score_all(cycle: Cycle, entries: tuple, candidates: tuple[int, ...], keep: bool = True
              ) -> tuple[np.ndarray | None, list | None, list] | None:
    """Score ``candidates`` with every entry of ``entries`` (WasmPolicies, in order).

    Returns ``(totals, results, ns)``: per entry its scores (finite, in [0, 1]) or the
    :class:`PluginError` it failed with, and the ns its call took (``None`` if it
    failed); ``totals`` is Σ weight × scores when every entry succeeded on the clean
    path, else ``None`` (the caller sums). ``results`` is ``None`` when every entry
    succeeded and ``keep`` is false (nobody reads the scores). ``None`` when the pick
    must take the Python path (see the module docstring): nothing was called then.
    """
    n = len(candidates)
    if not enabled or n == 0 or _call is None:
        return None
    plan = _plans.get(id(entries))
    stale = plan is None or plan.entries is not entries or plan.layout != LAYOUT[0]
    if not stale:
        for sup, inst, breaker in plan.live:
            if breaker.state != "closed":
                return None
            if sup._inst is not inst:  # an instance was re-created since
                stale = True
                break
    if stale and (plan := _new_plan(entries)) is None:
        return None
    if plan.resident:
        view = cycle.view
        for p, inst in plan.resident:
            if view is not p._fed_view or inst is not p._fed_inst:
                return None  # a new snapshot to deliver first: the Python path does it
    frame_a = (_frames.frame_for(cycle, candidates, inline_snapshot=True)
               if plan.any_a else b"")
    frame_b = (_frames.frame_for(cycle, candidates, inline_snapshot=False)
               if plan.any_b else b"")
    # Take every instance (its lock, its carried event), or none. (Buffers too small
    # for this pick: the C loop refuses before calling anything, and Python grows them.)
    # The instances taken are plan.insts[:len(events)]; the events are joined once.
    events: list = []
    ev_lens = plan.ev_lens
    carried: list = []
    for i, (inst, lock, ticking) in enumerate(plan.take):
        if (inst.deferred_failure is not None or not ticking.running
                or inst._store is None or not lock.acquire(False)):
            _release(plan.insts, events)
            return None
        ev = inst._pending
        events.append(ev)
        if ev is None:
            ev_lens[i] = 0
        else:
            inst._pending = None
            ev_lens[i] = len(ev)
            carried.append(ev)
    joined = b"".join(carried)
    if n > plan.cap:
        plan.room(n)
    t_start = _perf_ns()
    bad = _call(_fns_ptr, plan.table_ptr, plan.k, frame_a, len(frame_a), frame_b,
                len(frame_b), joined, plan.ev_ptr, n, plan.staging_ptr, plan.results_ptr)
    if bad < 0:  # a buffer to grow: nothing ran, the Python path grows it
        _release(plan.insts, events)
        return None
    k = plan.k
    res = plan.results.tolist()
    ns = res[2::3]
    if not bad:
        for (lock, stats, window, breaker), took in zip(plan.done, ns):
            lock.release()
            stats.calls += 1  # PolicyStats.succeeded, inline
            window.append(took)
            if breaker.consecutive or breaker.state != "closed":
                breaker.success()
            else:
                breaker._outcomes += 1  # CircuitBreaker.success while closed, inline
        if not keep:
            return plan.staging[k * n:(k + 1) * n].copy(), None, ns
        block = plan.staging[:(k + 1) * n].copy()
        return block[k * n:], [block[i * n:(i + 1) * n] for i in range(k)], ns
    block = plan.staging[:k * n].copy()
    results: list = [block[i * n:(i + 1) * n] for i in range(k)]
    t0 = t_start
    for i, e in enumerate(entries):
        code, aux, took = res[3 * i], res[3 * i + 1], res[3 * i + 2]
        inst = plan.insts[i]
        lock, stats, _window, breaker = plan.done[i]
        if code == NATIVE_OK:
            lock.release()
            stats.succeeded(took)
            breaker.success()
        else:
            size = len(frame_b if plan.frames[i] else frame_a)
            t_fix = _perf_ns()
            try:
                results[i] = e.plugin.native_finish(inst, code, aux, events[i], size, n, t0,
                                                    cycle, candidates)
                ns[i] = took + _perf_ns() - t_fix
            except PluginError as exc:
                results[i] = exc
                ns[i] = None
        t0 += took
    return None, results, ns


use_library()
