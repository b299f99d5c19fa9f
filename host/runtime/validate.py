"""validate(): smoke-run a module before it goes live.

Checks, on a fresh instance ``init``-ed with the given params:

- ``describe`` (if exported) decodes as a ``Describe``;
- ``score``/``filter`` on synthetic snapshots of 0, 1, 8 and 64 endpoints, without and
  with LoRA adapters, for a base-model and an adapter request, over all candidates and
  over a shuffled subset, with the snapshot inline and (if ``set_snapshot`` is
  exported) resident: the right number of results, scores finite and in [0, 1] (here
  out-of-range is an error, not clamped), and every call within its fuel with
  :data:`FUEL_HEADROOM` to spare (the largest case is 64 endpoints; production pools and
  prompts can be bigger). Judged on fuel only: the wall-clock backstop is
  ``VETTING_BACKSTOP_FACTOR`` budgets here, so a busy machine cannot fail a module;
- ``score`` is deterministic: the same input twice gives the same scores;
- ``pre_request`` and ``post_response`` (if exported) run once each;
- ``export_state`` -> ``import_state`` (if exported) round-trips into a fresh instance.

Any failure raises :class:`PolicyLoadError` naming the module, the call and the case.
On success, :func:`validate` returns the most fuel each request-path export used.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from epick import abi
from epick.runtime.errors import PolicyError, PolicyLoadError
from epick.runtime.instance import PolicyInstance
from epick.runtime.module import PolicyModule

__all__ = ["validate", "synthetic_snapshot", "FUEL_HEADROOM"]

#: A request-path export may use at most 1/FUEL_HEADROOM of ``Limits.fuel`` on the smoke
#: run, so a bigger pool or prompt in production does not run it out of fuel.
FUEL_HEADROOM = 4

_SIZES = (0, 1, 8, 64)
_ADAPTERS = ("sql-lora", "chat-lora", "code-lora", "math-lora")
_PROMPT = "You are a helpful assistant. " * 12  # a few prefix blocks


def synthetic_snapshot(n: int, *, adapters: bool, version: int = 1) -> abi.Snapshot:
    """A deterministic, varied snapshot of ``n`` endpoints (``10.1.<i//256>.<i%256>:8000``)."""
    endpoints = []
    for i in range(n):
        running = _ADAPTERS[: i % 3] if adapters else ()
        waiting = (_ADAPTERS[3],) if adapters and i % 4 == 1 else ()
        endpoints.append(
            abi.EndpointMetrics(
                address=f"10.1.{i // 256}.{i % 256}:8000",
                waiting=(i * 7) % 11,
                running=(i * 5) % 13,
                kv_usage=(i % 10) / 10,
                running_adapters=running,
                waiting_adapters=waiting,
                max_lora=4 if adapters else 0,
                num_gpu_blocks=4096 * (1 + i % 2),
                block_size=16,
            )
        )
    return abi.Snapshot(version=version, timestamp_ms=1_700_000_000_000, endpoints=tuple(endpoints))


def _requests() -> tuple[abi.Request, ...]:
    return (
        abi.Request(request_id="validate-base", model="base-model", prompt=_PROMPT, seed=1),
        abi.Request(
            request_id="validate-lora", model="base-model", adapter=_ADAPTERS[1],
            prompt=_PROMPT, seed=2, criticality=abi.Criticality.CRITICAL,
        ),
    )


def _fail(mod: PolicyModule, where: str, exc: PolicyError | None, detail: str = "") -> PolicyLoadError:
    export = exc.export if exc is not None else None
    return PolicyLoadError(
        mod.name, export, f"validation failed: {where}: {exc.detail if exc is not None else detail}"
    )


def validate(mod: PolicyModule, params: dict[str, Any] | None = None) -> dict[str, int]:
    """Smoke-run ``mod`` with ``params``; raise :class:`PolicyLoadError` on any problem.

    Returns ``{export: most fuel one call used}`` for the request-path exports (empty
    when the runtime does not consume fuel).
    """
    mod = mod.for_vetting()
    inst = mod.instantiate(params)  # PolicyLoadError already names init's complaint
    fuel: dict[str, int] = {}
    try:
        _run(mod, _Metered(inst, fuel), params)
    finally:
        inst.close()
    budget = mod.runtime.limits.fuel
    for export, used in fuel.items():
        if used * FUEL_HEADROOM > budget:
            raise PolicyLoadError(
                mod.name, export,
                f"validation failed: {export} used {used:,} instructions on the smoke run; "
                f"the per-call fuel is {budget:,} and a policy must leave {FUEL_HEADROOM}x "
                f"headroom (at most {budget // FUEL_HEADROOM:,})",
            )
    return fuel


class _Metered:
    """An instance whose request-path calls record the most fuel each export used."""

    def __init__(self, inst: PolicyInstance, fuel: dict[str, int]) -> None:
        self._inst = inst
        self._fuel = fuel

    def __getattr__(self, attr: str) -> Any:
        target = getattr(self._inst, attr)
        if attr not in ("score", "filter", "set_snapshot", "pre_request", "post_response"):
            return target

        def metered(*args: Any) -> Any:
            result = target(*args)
            used = self._inst.fuel_used(attr)
            if used is not None and used > self._fuel.get(attr, 0):
                self._fuel[attr] = used
            return result

        return metered


def _run(mod: PolicyModule, inst: PolicyInstance, params: dict[str, Any] | None) -> None:
    if inst.has("describe"):
        try:
            inst.describe()
        except PolicyError as exc:
            raise _fail(mod, "describe", exc) from exc

    modes = [False, True] if inst.has("set_snapshot") else [False]
    version = 0
    for n in _SIZES:
        for adapters in (False, True):
            version += 1
            snap = synthetic_snapshot(n, adapters=adapters, version=version)
            encoded = abi.encoder.encode(snap)
            subsets = [tuple(range(n))]
            if n >= 8:
                subsets.append(tuple(range(n - 1, -1, -2)))
            for resident in modes:
                case = (
                    f"{n} endpoints, {'with' if adapters else 'no'} adapters, "
                    f"{'resident' if resident else 'inline'} snapshot"
                )
                if resident:
                    try:
                        inst.set_snapshot(encoded)
                    except PolicyError as exc:
                        raise _fail(mod, f"set_snapshot ({case})", exc) from exc
                for request in _requests():
                    for candidates in subsets:
                        blob = abi.encoder.encode(
                            abi.ScoreInput(
                                snapshot=None if resident else snap,
                                request=request,
                                candidates=candidates,
                            )
                        )
                        _check_call(mod, inst, blob, len(candidates), case)

    pick = synthetic_snapshot(8, adapters=True)
    request = _requests()[1]
    if inst.has("pre_request"):
        event = abi.PreRequestEvent(
            request=request, endpoint=pick.endpoints[2].address, timestamp_ms=pick.timestamp_ms
        )
        try:
            inst.pre_request(abi.encoder.encode(event))
        except PolicyError as exc:
            raise _fail(mod, "pre_request", exc) from exc
    if inst.has("post_response"):
        event = abi.PostResponseEvent(
            request_id=request.request_id, adapter=request.adapter,
            endpoint=pick.endpoints[2].address, timestamp_ms=pick.timestamp_ms + 50,
            model=request.model,
        )
        try:
            inst.post_response(abi.encoder.encode(event))
        except PolicyError as exc:
            raise _fail(mod, "post_response", exc) from exc
    if inst.has("export_state") and inst.has("import_state"):
        try:
            state = inst.export_state()
        except PolicyError as exc:
            raise _fail(mod, "export_state", exc) from exc
        fresh = mod.instantiate(params)
        try:
            fresh.import_state(state)
        except PolicyError as exc:
            raise _fail(mod, "import_state of its own export_state", exc) from exc
        finally:
            fresh.close()


def _check_call(mod: PolicyModule, inst: PolicyInstance, blob: bytes, n: int, case: str) -> None:
    if inst.has("score"):
        where = f"score ({case}, {n} candidates)"
        try:
            scores = inst.score(blob, n)
            again = inst.score(blob, n)
        except PolicyError as exc:
            raise _fail(mod, where, exc) from exc
        for i, s in enumerate(scores.tolist()):
            if not 0.0 <= s <= 1.0:  # False for NaN too
                raise _fail(
                    mod, where, None,
                    f"score {s!r} for candidate {i}; scores must be finite and in [0, 1]",
                )
        if not np.array_equal(scores, again):
            i = int(np.flatnonzero(scores != again)[0])
            raise _fail(
                mod, where, None,
                f"score is not deterministic: the same input gave different scores (candidate "
                f"{i}: {float(scores[i]):.6g}, then {float(again[i]):.6g}); a read past the end of "
                "an input (candidates, endpoints, the prompt) is the usual cause, and may trap "
                "elsewhere",
            )
    if inst.has("filter"):
        try:
            inst.filter(blob, n)
        except PolicyError as exc:
            raise _fail(mod, f"filter ({case}, {n} candidates)", exc) from exc
