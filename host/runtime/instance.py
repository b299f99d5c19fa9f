"""One live policy: a wasmtime Store plus an instance of a :class:`PolicyModule`.

Calls follow policies/ABI.md. The host writes every input into one input buffer and
reads ``score``/``filter`` results from one output buffer, both obtained from the
guest's ``alloc`` when the instance starts and re-obtained (doubling) when too small.

How a wrong result count is detected: before ``score``/``filter`` the host fills
``n + 1`` output slots with a sentinel (for ``score`` the f64 bit pattern
:data:`SCORE_SENTINEL`, a NaN no arithmetic produces; for ``filter`` the byte ``0xFF``).
After the call a sentinel left in the first ``n`` slots means the guest wrote too few
results, and a changed slot ``n`` means it wrote too many; both raise
:class:`PolicyOutputError`. ``score`` returns everything else raw (NaN, inf, values
outside [0, 1] included): judging scores is the caller's job (``WasmPolicy`` and
``validate`` do it).

Threads: a Store must never be used from two threads at once. Every call takes a
non-blocking per-instance lock; a second thread arriving mid-call gets a
``RuntimeError`` instead of corrupting the Store. Handing an instance from one thread to
another between calls is fine (wasmtime Stores are ``Send``, not ``Sync``); the service
runs all picks on its event-loop thread.
"""

from __future__ import annotations

import re
import struct
import threading
from typing import Any

import msgspec
import numpy as np
import wasmtime

from epick import abi
from epick.runtime._guest import LAYOUT, GuestFunc, GuestMemory, trap_reason
from epick.runtime.errors import (
    PolicyCallError,
    PolicyError,
    PolicyLoadError,
    PolicyOutputError,
    PolicyTimeout,
)
from epick.runtime.exports import SIGNATURES
from epick.runtime.limits import VETTING_BACKSTOP_FACTOR
from epick.runtime.seams import Compiled

__all__ = ["PolicyInstance", "SCORE_SENTINEL", "MAX_ERROR_BYTES", "instantiate_error"]

#: Bit pattern written into unfilled score slots (a quiet NaN with a marker payload).
SCORE_SENTINEL = np.uint64(0x7FF8_E91C_5C0E_0BAD)
_KEEP_SENTINEL = np.uint8(0xFF)
_ONE_BITS = int(np.float64(1.0).view(np.uint64))
_SENTINEL_INT = int(SCORE_SENTINEL)
#: The longest guest error message reported; longer ones are cut.
MAX_ERROR_BYTES = 256

_U32 = 0xFFFF_FFFF
_EVENT_AT = abi.FRAME_EVENT_LEN_AT
_POSITION = re.compile(r"`\$\[(\d+)\]")
_SCORE_INPUT_FIELDS = abi.ScoreInput.__struct_fields__
#: What the native loop reports per scorer (host/runtime/native/epick_scoreall.c).
NATIVE_OK, NATIVE_TRAP, NATIVE_STATUS, NATIVE_EVENT_FAILED, NATIVE_DIRTY = 0, 1, 2, 3, 4
_HOT = frozenset({"score", "filter", "set_snapshot", "pre_request", "post_response"})
_INITIAL_INPUT = 16 << 10
_INITIAL_OUTPUT_SLOTS = 512
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_params_encoder = msgspec.msgpack.Encoder()
_describe_decoder = msgspec.msgpack.Decoder(abi.Describe)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def instantiate_error(name: str, exc: BaseException, *, has_start: bool, fuel: int,
                      backstop_ms: float) -> PolicyLoadError:
    """A clear refusal for a failed ``wasmtime.Instance`` (a start function's trap, loop…)."""
    code = getattr(exc, "trap_code", None)
    if isinstance(exc, wasmtime.Trap) or code is not None:
        where = "its start function" if has_start else "instantiation"
        if code is wasmtime.TrapCode.OUT_OF_FUEL:
            why = f"{where} ran out of fuel (its budget is {fuel:,} instructions)"
        elif code is wasmtime.TrapCode.INTERRUPT:
            why = f"{where} exceeded its {backstop_ms:g} ms backstop"
        else:
            why = f"{where} trapped: {trap_reason(str(exc))}"
        return PolicyLoadError(name, None, f"cannot instantiate: {why}")
    return PolicyLoadError(name, None, f"cannot instantiate: {first_line(exc)}")


class PolicyInstance:
    """A policy module instantiated in its own Store, ``init``-ed with ``params``.

    Made by :meth:`PolicyModule.instantiate`. Raises :class:`PolicyLoadError` when the
    module cannot be instantiated (its minimum memory or table exceeds the cap, its start
    function traps, loops or runs out of fuel), its first ``alloc`` calls fail, or
    ``init`` fails: non-zero (``.message`` is the guest's text), trap or timeout.

    Every Store is capped by :meth:`Runtime.new_store`: one memory of at most
    ``Limits.memory_bytes``, at most ``Limits.tables`` tables of ``Limits.table_elements``
    each, one instance; every call by fuel and the epoch backstop.
    """

    def __init__(self, module: Compiled, params: dict[str, Any] | None = None) -> None:
        rt = module.runtime
        rt._check_open()
        self.module = module
        self.name = module.name
        self.exports: frozenset[str] = module.exports
        self._ticker = rt.ticker
        self._ticking = rt.ticker.flag  # .running read on every call
        lim = rt.limits
        self._cap = lim.memory_bytes
        self._lock = threading.Lock()

        vet_ms = lim.budget_ms * VETTING_BACKSTOP_FACTOR
        start_ms = max(lim.control_budget_ms, vet_ms) if module.vetting else lim.control_budget_ms
        store = rt.new_store(backstop_ms=start_ms)
        try:
            instance = wasmtime.Instance(store, module._module, [])
        except (wasmtime.WasmtimeError, wasmtime.Trap) as exc:
            raise instantiate_error(self.name, exc, has_start=module.has_start,
                                    fuel=lim.control_fuel, backstop_ms=start_ms) from exc
        self._store = store
        exported = instance.exports(store)
        self._memory = GuestMemory(store, exported["memory"])  # type: ignore[arg-type]
        funcs: dict[str, GuestFunc] = {}
        for export, (params_sig, _) in SIGNATURES.items():
            if export in self.exports:
                hot = export in _HOT
                budget = lim.budget_ms if hot else lim.control_budget_ms
                if module.vetting:
                    budget = max(budget, vet_ms)
                funcs[export] = GuestFunc(
                    store, exported[export], len(params_sig),  # type: ignore[arg-type]
                    policy=self.name, export=export, budget_ms=budget,
                    ticks=rt.ticks_for(budget),
                    fuel=rt.fuel_for(lim.fuel if hot else lim.control_fuel),
                    on_trap=self._trap_context,
                )
        self._funcs = funcs
        #: 1 or 2 (policies/ABI.md): version 2 takes score frames and carried events.
        self.abi_version: int = getattr(module, "abi_version", 1)
        self._v2 = self.abi_version >= 2
        #: A version 2 instance's pre_request event not delivered yet: it rides on the next
        #: score/filter call, or is flushed by its own call before anything else.
        self._pending: bytes | None = None
        #: The last carried event's failure, for the owner to report as pre_request's.
        self.deferred_failure: PolicyError | None = None
        self._score_ev = self._filter_ev = None
        if self._v2 and "pre_request" in funcs:
            # The call carrying an event gets both calls' budgets.
            for export in ("score", "filter"):
                if export in funcs:
                    setattr(self, f"_{export}_ev", GuestFunc(
                        store, exported[export], 3,  # type: ignore[arg-type]
                        policy=self.name, export=f"{export} (carrying pre_request)",
                        budget_ms=2 * funcs[export].budget_ms,
                        ticks=rt.ticks_for(2 * funcs[export].budget_ms),
                        fuel=2 * funcs[export].fuel, on_trap=self._trap_context,
                    ))
        self._score = funcs.get("score")
        self._filter = funcs.get("filter")
        self._set_snapshot = funcs.get("set_snapshot")
        self._pre_request = funcs.get("pre_request")
        self._post_response = funcs.get("post_response")

        self._in_ptr = self._in_cap = 0
        self._in_mv = memoryview(b"")
        self._out_ptr = self._out_slots = 0
        self._out_f64 = self._out_u64 = np.empty(0)
        self._out_u8 = np.empty(0, dtype=np.uint8)
        self._out_mv = memoryview(b"")
        self._out_q = memoryview(b"").cast("Q")
        try:
            self._grow_input(_INITIAL_INPUT)
            self._grow_output(_INITIAL_OUTPUT_SLOTS)
            self.init(params)
        except PolicyLoadError:
            raise
        except PolicyError as exc:  # alloc or init trapped, timed out, misbehaved
            raise PolicyLoadError(self.name, exc.export, exc.detail) from exc

    def __repr__(self) -> str:
        return f"<PolicyInstance {self.name!r} sha256={self.module.sha256[:12]}>"

    def has(self, export: str) -> bool:
        """Whether the module exports ``export``."""
        return export in self.exports

    def fuel_used(self, export: str) -> int | None:
        """Fuel the last call of ``export`` used (``None``: fuel off or not exported).

        Valid right after that call, before any other call into this instance."""
        func = self._funcs.get(export)
        return None if func is None else func.fuel_used()

    # -- the request path ---------------------------------------------------------------

    def score(self, blob: bytes, n: int) -> np.ndarray:
        """Run ``score`` on a msgpack ``ScoreInput`` with ``n`` candidates.

        Returns a float64 copy of the ``n`` scores, raw: NaN, inf and out-of-range values
        are returned as written. Raises PolicyCallError / PolicyTrap / PolicyTimeout, and
        PolicyOutputError when the guest wrote a wrong number of scores.
        """
        return self.score_checked(blob, n)[0]

    def score_checked(self, blob: bytes, n: int) -> tuple[np.ndarray, bool]:
        """:meth:`score`, plus whether every score is in [0, 1] (no NaN, no inf).

        One pass answers both that and the count check, so callers that judge scores
        (``WasmPolicy``) need not scan them again.
        """
        if self._v2:
            return self.score_frame(self._frame_of(blob, "score"), n)
        return self.score_frame(blob, n)  # a v1 instance never has an event pending

    def score_frame(self, frame: bytes, n: int) -> tuple[np.ndarray, bool]:
        """:meth:`score_checked` of a version 2 instance on a score frame (made once per
        pick by :func:`epick.abi.encode_frame`); the pending pre_request event, if any,
        rides along (policies/ABI.md, "The score frame"). A version 1 instance's msgpack
        input takes the same path: it never has an event pending."""
        func = self._score
        if func is None:
            raise self._missing("score")
        lock = self._lock
        if not lock.acquire(False):
            raise self._busy()
        try:
            if not self._ticking.running:
                self._check_ticker()
            size = len(frame)
            pending = self._pending
            need = size if pending is None else size + len(pending)
            if need > self._in_cap:
                self._grow_input(need)
            self._in_mv[:size] = frame
            if n >= self._out_slots:
                self._grow_output(n + 1)
            end = 8 * (n + 1)
            self._out_mv[:end] = self._sentinels[:end]
            if pending is None:
                status = func.call3(self._in_ptr, size, self._out_ptr)
            else:
                status = self._call_carrying(self._score_ev, func, size, "score")
            return self._score_read(status, n)
        finally:
            lock.release()

    def _score_read(self, status: int, n: int) -> tuple[np.ndarray, bool]:
        """The read-back of a ``score`` call that returned ``status`` (the lock held)."""
        if status:
            raise PolicyCallError(self.name, "score", status, self._error_message())
        # Slot n read as a Python int (a numpy scalar costs more than this whole check).
        q = self._out_q
        if q[n] != _SENTINEL_INT:
            raise PolicyOutputError(
                self.name, "score", f"score wrote more than the {n} scores asked for"
            )
        # Non-negative doubles order like their bit patterns, and every NaN (the
        # sentinel included), inf and negative number has a pattern above 1.0's: the
        # largest pattern tells "all in [0, 1]" (and so "all written"). argmax finds
        # it for a quarter of what np.maximum.reduce costs.
        top = q[self._out_u64[:n].argmax()] if n else 0
        scores = self._out_f64[:n].copy()
        if top <= _ONE_BITS:
            return scores, True
        written = scores.view(np.uint64) != SCORE_SENTINEL
        if not written.all():
            raise PolicyOutputError(
                self.name, "score",
                f"score wrote {int(written.sum())} of {n} scores "
                f"(first missing: candidate {int(np.argmin(written))})",
            )
        return scores, False

    # -- the native loop (epick.runtime.scoreall) ------------------------------------------

    def native_score_finish(self, code: int, aux: int, event: bytes | None, size: int,
                            n: int) -> tuple[np.ndarray, bool]:
        """Finish a ``score`` call the native loop made but did not find clean, with the
        steps :meth:`score_frame` takes after its call (``code``/``aux``: what the loop
        reported; ``size``: the frame's length without the event). Raises as it does."""
        try:
            if code == NATIVE_TRAP:
                func = self._score_ev if event is not None else self._score
                assert func is not None
                try:
                    func._raise(aux or None)
                except PolicyTimeout:
                    if event is not None:
                        self._pending = event  # re-sent by a retry, as _call_carrying does
                    raise
            status = aux
            if code == NATIVE_EVENT_FAILED:
                message = self._error_message()
                failure = PolicyCallError(self.name, "pre_request", status, message)
                PolicyError.__init__(failure, self.name, "pre_request",
                                     f"pre_request (carried by score) failed: {message}")
                self.deferred_failure = failure
                assert self._score is not None
                status = self._score.call3(self._in_ptr, size, self._out_ptr)
            return self._score_read(status if code != NATIVE_DIRTY else 0, n)
        finally:
            self._lock.release()

    def _call_carrying(self, carrying: GuestFunc | None, plain: GuestFunc, size: int,
                       export: str) -> int:
        """Call ``score``/``filter`` on the frame at the input buffer (``size`` bytes) with
        the pending event appended; an event that fails (status FRAME_EVENT_FAILED) is
        kept in :attr:`deferred_failure` and the call made again without it. The lock
        is held by the caller."""
        event, self._pending = self._pending, None
        assert event is not None and carrying is not None
        end = size + len(event)  # the caller made room for it
        mv = self._in_mv
        mv[size:end] = event
        mv[_EVENT_AT:_EVENT_AT + 4] = len(event).to_bytes(4, "little")
        try:
            status = carrying.call3(self._in_ptr, end, self._out_ptr)
        except PolicyTimeout:
            # Cut off by the wall-clock backstop (a busy machine can do that): a caller
            # that retries on this instance re-sends the event, as it would re-send a
            # version 1 pre_request. A trap leaves it dropped: the instance is replaced.
            self._pending = event
            raise
        finally:
            mv[_EVENT_AT:_EVENT_AT + 4] = b"\0\0\0\0"
        if status != abi.FRAME_EVENT_FAILED:
            return status
        message = self._error_message()
        failure = PolicyCallError(self.name, "pre_request", status, message)
        PolicyError.__init__(failure, self.name, "pre_request",
                             f"pre_request (carried by {export}) failed: {message}")
        self.deferred_failure = failure
        return plain.call3(self._in_ptr, size, self._out_ptr)

    def filter(self, blob: bytes, n: int) -> np.ndarray:
        """Run ``filter``; returns a bool keep-mask of length ``n`` (a copy).

        Raises like :meth:`score`; PolicyOutputError also for a keep byte other than 0/1.
        A version 2 instance gets ``blob`` as a frame (:func:`epick.abi.frame_from_score_input`).
        """
        if self._v2:
            return self.filter_frame(self._frame_of(blob, "filter"), n)
        return self._filter_call(blob, n)

    def filter_frame(self, frame: bytes, n: int) -> np.ndarray:
        """:meth:`filter` of a version 2 instance on a score frame (carrying the pending
        pre_request event, if any)."""
        return self._filter_call(frame, n, framed=True)

    def _filter_call(self, blob: bytes, n: int, framed: bool = False) -> np.ndarray:
        func = self._filter
        if func is None:
            raise self._missing("filter")
        if not self._lock.acquire(False):
            raise self._busy()
        try:
            self._check_ticker()
            if framed and self._pending is not None and len(blob) + len(self._pending) > self._in_cap:
                self._grow_input(len(blob) + len(self._pending))
            size = self._put_input(blob)
            if n >= self._out_slots:
                self._grow_output(n + 1)
            keep = self._out_u8
            keep[: n + 1] = _KEEP_SENTINEL
            if framed and self._pending is not None:
                status = self._call_carrying(self._filter_ev, func, size, "filter")
            else:
                status = func.call3(self._in_ptr, size, self._out_ptr)
            if status:
                raise PolicyCallError(self.name, "filter", status, self._error_message())
            if keep[n] != _KEEP_SENTINEL:
                raise PolicyOutputError(
                    self.name, "filter", f"filter wrote more than the {n} keep bytes asked for"
                )
            mask = keep[:n].copy()
            if n and mask.max() > 1:
                unwritten = mask == _KEEP_SENTINEL
                if unwritten.any():
                    raise PolicyOutputError(
                        self.name, "filter",
                        f"filter wrote {n - int(unwritten.sum())} of {n} keep bytes "
                        f"(first missing: candidate {int(np.argmax(unwritten))})",
                    )
                bad = int(np.argmax(mask > 1))
                raise PolicyOutputError(
                    self.name, "filter",
                    f"filter wrote keep byte {int(mask[bad])} for candidate {bad}; expected 0 or 1",
                )
            return mask.view(np.bool_)
        finally:
            self._lock.release()

    def set_snapshot(self, blob: bytes) -> None:
        """Deliver a msgpack ``Snapshot`` to keep resident."""
        self._call_blob(self._set_snapshot, "set_snapshot", blob)

    def pre_request(self, blob: bytes) -> None:
        """Deliver a msgpack ``PreRequestEvent`` now (after a pending one)."""
        if self._pending is not None:
            self.flush()
        # _call_blob inlined: every pick of a version 1 policy runs this once.
        func = self._pre_request
        if func is None:
            raise self._missing("pre_request")
        lock = self._lock
        if not lock.acquire(False):
            raise self._busy()
        try:
            if not self._ticking.running:
                self._check_ticker()
            size = len(blob)
            if size > self._in_cap:
                self._grow_input(size)
            self._in_mv[:size] = blob
            status = func.call2(self._in_ptr, size)
            if status:
                raise PolicyCallError(self.name, "pre_request", status, self._error_message())
        finally:
            lock.release()

    def defer_pre_request(self, blob: bytes) -> None:
        """Version 2: keep the ``PreRequestEvent`` for the next ``score``/``filter`` call
        (one crossing per decision). Any other call delivers it first (:meth:`flush`), so
        the policy sees the calls in version 1's order."""
        if not self._v2 or self._pre_request is None:
            self.pre_request(blob)
            return
        if self._pending is not None:
            self.flush()
        self._pending = blob

    @property
    def pending(self) -> bool:
        """A pre_request event waits for the next score/filter call."""
        return self._pending is not None

    def flush(self) -> None:
        """Deliver the pending pre_request event with its own call. A non-zero return is
        kept in :attr:`deferred_failure` (the event was the earlier decision's); a trap
        or timeout raises, as the call it precedes would have."""
        event, self._pending = self._pending, None
        if event is None:
            return
        try:
            self._call_blob(self._pre_request, "pre_request", event)
        except PolicyCallError as exc:
            self.deferred_failure = exc

    def take_deferred_failure(self) -> PolicyError | None:
        """The last carried or flushed event's failure (then forgotten), or ``None``."""
        exc, self.deferred_failure = self.deferred_failure, None
        return exc

    def post_response(self, blob: bytes) -> None:
        """Deliver a msgpack ``PostResponseEvent``."""
        self._call_blob(self._post_response, "post_response", blob)

    # -- the control plane --------------------------------------------------------------

    def init(self, params: dict[str, Any] | None = None) -> None:
        """(Re-)configure from ``params``; resets all of the policy's state.

        Raises PolicyLoadError when ``params`` is not a str-keyed dict, cannot be encoded,
        or the guest refuses it (``.message`` is the guest's text).
        """
        if params is None:
            params = {}
        if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
            raise PolicyLoadError(
                self.name, "init", f"params must be a dict with str keys, got {params!r:.80}"
            )
        try:
            blob = _params_encoder.encode(params)
        except (TypeError, msgspec.EncodeError) as exc:
            raise PolicyLoadError(self.name, "init", f"params cannot be encoded as msgpack: {exc}") from exc
        try:
            self._call_blob(self._funcs.get("init"), "init", blob)
        except PolicyCallError as exc:
            raise PolicyLoadError(
                self.name, "init", f"init refused its params: {exc.message}", message=exc.message
            ) from exc

    def describe(self) -> abi.Describe:
        """The policy's ``Describe``; ``Describe(name=<module name>)`` if not exported."""
        if "describe" not in self.exports:
            return abi.Describe(name=self.name)
        if "describe" not in self._funcs:
            raise self._missing("describe")  # closed
        raw = self._produce("describe")
        try:
            return _describe_decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise PolicyOutputError(
                self.name, "describe", f"describe wrote an invalid Describe: {exc}"
            ) from exc

    def export_state(self) -> bytes:
        """The policy's state as opaque bytes (for hot swap and trap recovery)."""
        if "export_state" not in self._funcs:
            raise self._missing("export_state")
        return self._produce("export_state")

    def import_state(self, blob: bytes) -> None:
        """Take state from ``export_state``; on error the policy is freshly initialised."""
        self._call_blob(self._funcs.get("import_state"), "import_state", blob)

    def close(self) -> None:
        """Drop the Store now instead of at garbage collection. The instance is unusable after."""
        self._funcs = {}
        self._score = self._filter = self._set_snapshot = None
        self._pre_request = self._post_response = None
        self._score_ev = self._filter_ev = None
        self._pending = None
        self._in_mv = memoryview(b"")
        self._out_q = memoryview(b"").cast("Q")
        self._out_f64 = self._out_u64 = np.empty(0)
        self._out_u8 = np.empty(0, dtype=np.uint8)
        self._out_mv = memoryview(b"")
        self._out_slots = self._in_cap = 0
        self._memory = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]

    # -- internals ----------------------------------------------------------------------

    def _frame_of(self, blob: bytes, export: str) -> bytes:
        """The score frame carrying msgpack ``ScoreInput`` ``blob`` (version 2)."""
        try:
            return abi.frame_from_score_input(blob)
        except (msgspec.DecodeError, ValueError, OverflowError, struct.error) as exc:
            # msgspec says where by position ("at `$[5][0]`"): name the ScoreInput field.
            text = _POSITION.sub(lambda m: f"`{_SCORE_INPUT_FIELDS[int(m.group(1))]}",
                                 str(exc)) if isinstance(exc, msgspec.DecodeError) else str(exc)
            exc = type(exc)(text)
            err = PolicyCallError(self.name, export, 0, "")
            PolicyError.__init__(err, self.name, export,
                                 f"{export} not called: the host cannot frame this ScoreInput: {exc}")
            err.message = str(exc)
            raise err from exc

    def _put_input(self, blob: bytes) -> int:
        """Copy ``blob`` into the guest's input buffer (grown first if too small)."""
        size = len(blob)
        if size > self._in_cap:
            self._grow_input(size)
        self._in_mv[:size] = blob
        return size

    def _call_blob(self, func: GuestFunc | None, export: str, blob: bytes) -> None:
        if func is None:
            raise self._missing(export)
        if self._pending is not None and export != "pre_request":
            self.flush()
        lock = self._lock
        if not lock.acquire(False):
            raise self._busy()
        try:
            if not self._ticking.running:
                self._check_ticker()
            size = len(blob)
            if size > self._in_cap:
                self._grow_input(size)
            self._in_mv[:size] = blob
            status = func.call2(self._in_ptr, size)
            if status:
                raise PolicyCallError(self.name, export, status, self._error_message())
        finally:
            lock.release()

    def _produce(self, export: str) -> bytes:
        """Call a ``() -> status`` export that leaves bytes at output_ptr/output_len."""
        if self._pending is not None:
            self.flush()
        if not self._lock.acquire(False):
            raise self._busy()
        try:
            self._check_ticker()
            status = self._funcs[export].call0()
            if status:
                raise PolicyCallError(self.name, export, status, self._error_message())
            ptr = self._funcs["output_ptr"].call0() & _U32
            size = self._funcs["output_len"].call0() & _U32
            try:
                return self._memory.read(ptr, size)
            except IndexError as exc:
                raise PolicyOutputError(
                    self.name, export,
                    f"{export} output [{ptr}, {ptr + size}) is outside memory "
                    f"({self._memory.size} bytes)",
                ) from exc
        finally:
            self._lock.release()

    def _alloc(self, nbytes: int) -> int:
        """``nbytes`` of guest memory, 8-byte aligned (the host over-asks by 7)."""
        raw = self._funcs["alloc"].call1(nbytes + 7) & _U32
        if raw == 0:
            raise PolicyCallError(
                self.name, "alloc", 0, f"out of memory (asked for {nbytes + 7} bytes)"
            )
        ptr = (raw + 7) & ~7
        if not self._memory.contains(ptr, nbytes):
            raise PolicyOutputError(
                self.name, "alloc",
                f"alloc({nbytes + 7}) returned {raw}, outside memory ({self._memory.size} bytes)",
            )
        return ptr

    def _grow_input(self, need: int) -> None:
        cap = max(need, 2 * self._in_cap, _INITIAL_INPUT)
        LAYOUT[0] += 1
        self._in_ptr = self._alloc(cap)
        self._in_cap = cap
        self._in_mv = memoryview(self._memory.view(self._in_ptr, cap))

    def _grow_output(self, slots: int) -> None:
        slots = max(slots, 2 * self._out_slots, _INITIAL_OUTPUT_SLOTS)
        LAYOUT[0] += 1
        self._out_ptr = self._alloc(slots * 8)
        self._out_slots = slots
        self._out_u8 = self._memory.view(self._out_ptr, slots * 8)
        self._out_mv = memoryview(self._out_u8)
        self._sentinels = memoryview(SCORE_SENTINEL.tobytes() * slots)
        self._out_f64 = self._out_u8.view(np.float64)
        self._out_u64 = self._out_u8.view(np.uint64)
        self._out_q = self._out_mv.cast("Q")

    def _error_message(self) -> str:
        """The guest's message for its last non-zero return, made safe to log."""
        try:
            ptr = self._funcs["error_ptr"].call0() & _U32
            size = self._funcs["error_len"].call0() & _U32
        except PolicyError as exc:
            return f"(no error message: {exc.detail})"
        if size == 0:
            return "(no error message)"
        shown = min(size, MAX_ERROR_BYTES)
        try:
            raw = self._memory.read(ptr, shown)
        except IndexError:
            return f"(unreadable error message: {size} bytes at {ptr}, outside memory)"
        text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", raw.decode("utf-8", "replace"))
        if size > shown:
            text += f"… ({size} bytes, cut)"
        return text

    def _trap_context(self) -> str:
        said = self._panic_message()
        memory = getattr(self, "_memory", None)
        # memory.grow fails silently (-1) at the cap; a trap soon after is most likely
        # the guest's reaction to that, so say so.
        if memory is not None and memory.size + (1 << 20) > self._cap:
            return f"{said} (memory at {_mib(memory.size)} of its {_mib(self._cap)} cap)"
        return said

    def _panic_message(self) -> str:
        """``(panic: MSG)`` when the trap was a guest panic that left its message where
        errors go (the Zig SDK's panic handler does; it clears the message at the start
        of every call, so one found here is this call's). The trap alone only says
        'unreachable'."""
        funcs = getattr(self, "_funcs", None)
        if not funcs or "error_len" not in funcs or getattr(self, "_reading_panic", False):
            return ""
        self._reading_panic = True  # error_ptr trapping in turn must not recurse
        try:
            message = self._error_message()
        finally:
            self._reading_panic = False
        return f" ({message})" if message.startswith("panic: ") else ""

    def _check_ticker(self) -> None:
        if not self._ticker.running:
            raise RuntimeError(
                f"policy {self.name!r}: its Runtime is closed (no epoch ticker, calls could "
                f"run forever)"
            )

    def _missing(self, export: str) -> Exception:
        if self._store is None:
            return RuntimeError(f"policy {self.name!r}: instance is closed")
        return PolicyError(self.name, export, f"does not export {export!r}")

    def _busy(self) -> RuntimeError:
        return RuntimeError(
            f"policy {self.name!r}: instance is in use by another thread; a PolicyInstance "
            f"(its wasmtime Store) must be used by one thread at a time"
        )
