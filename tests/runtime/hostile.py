"""The hostile modules of the service-level sandbox tests and `epick bench sandbox-under-fire`:
each passes the smoke run, then misbehaves in service (see wat/hostile.wat).

``HOSTILE[name]`` -> wasm bytes; ``hostile_wasm(**parts)`` builds a custom one.
Requests with a model starting with ``H`` (:data:`MODEL`) trigger the score cases.
"""

from __future__ import annotations

from wat_modules import wasm

__all__ = ["HOSTILE", "MODEL", "SLOW_FAIL_EVERY_THIRD", "SPIN_EVERY_OTHER", "TRAP_EVERY_OTHER",
           "hostile_wasm"]

MODEL = "Hostile-model"

_NOTHING = "(nop)"
_SPIN = "(loop $forever (br $forever))"
_EVERY_OTHER = ("(if (i32.and (global.get $calls) (i32.const 1))"
                " (then (return (call $fail (i32.const 16) (i32.const 16)))))")
#: Each fresh instance's 2nd, 4th… score traps (the instance is re-created after a trap).
TRAP_EVERY_OTHER = ("(if (i32.eqz (i32.and (global.get $calls) (i32.const 1)))"
                    " (then unreachable))")
#: Every 2nd score spins until its fuel runs out.
SPIN_EVERY_OTHER = ("(if (i32.eqz (i32.and (global.get $calls) (i32.const 1)))"
                    " (then (loop $forever (br $forever))))")
#: Every 3rd score works through ~7 M instructions, then fails (an error, not a trap:
#: the instance lives on, and 1 in 3 is under the breaker's 50%).
SLOW_FAIL_EVERY_THIRD = ("(if (i32.eqz (i32.rem_u (global.get $calls) (i32.const 3)))"
                         " (then (local.set $n (i32.const 900000))"
                         " (block $done (loop $l (br_if $done (i32.eqz (local.get $n)))"
                         " (local.set $n (i32.sub (local.get $n) (i32.const 1))) (br $l)))"
                         " (return (call $fail (i32.const 16) (i32.const 16)))))")
_EVERY_THIRD_TRAPS = ("(if (i32.eqz (i32.rem_u (global.get $calls) (i32.const 3)))"
                      " (then unreachable))")
_GROW = ("(drop (table.grow $t (ref.null func) (i32.const 25000000)))"
         " (loop $more (br_if $more (i32.ne (memory.grow (i32.const 16)) (i32.const -1))))"
         " (i32.store8 (i32.mul (memory.size) (i32.const 65536)) (i32.const 1))")


def hostile_wasm(*, score_bad: str = _NOTHING, pre_bad: str = _NOTHING,
                 init_loops: int = 0) -> bytes:
    return bytes(wasm("hostile", score_bad=score_bad, pre_bad=pre_bad, init_loops=init_loops))


#: name -> (what it does, wasm)
HOSTILE: dict[str, tuple[str, bytes]] = {
    "benign": ("behaves (the baseline)", hostile_wasm()),
    "spin": ("score never returns", hostile_wasm(score_bad=_SPIN)),
    "trapping-hook": ("pre_request traps on every pick", hostile_wasm(pre_bad="unreachable")),
    "every-other": ("score fails every 2nd call", hostile_wasm(score_bad=_EVERY_OTHER)),
    "trap-every-other": ("each instance's score traps on its 2nd call",
                         hostile_wasm(score_bad=TRAP_EVERY_OTHER)),
    "burn-every-other": ("each instance's 2nd score spins until its fuel is gone",
                         hostile_wasm(score_bad=SPIN_EVERY_OTHER)),
    "slow-fail-every-third": ("every 3rd score burns ~7 M instructions, then fails",
                              hostile_wasm(score_bad=SLOW_FAIL_EVERY_THIRD)),
    "slow-start-trap": ("a ~30 ms init, and score traps every 3rd call",
                        hostile_wasm(score_bad=_EVERY_THIRD_TRAPS, init_loops=15_000_000)),
    "hog": ("score grows its table and memory to the caps, then traps",
            hostile_wasm(score_bad=_GROW)),
}
