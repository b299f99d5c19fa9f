"""The pickers (:class:`epick.interfaces.Picker`): turn weighted totals into an ordered
answer (primary first, then fallbacks).

Both are deterministic for a given seed; without a seed they draw from the process RNG.
"""

from __future__ import annotations

import random

import numpy as np

from epick.interfaces import Picker

__all__ = ["MaxScorePicker", "WeightedRandomPicker", "make_picker"]

_PROCESS_RNG = random.Random()


def _rng(seed: int | None) -> random.Random:
    return _PROCESS_RNG if seed is None else random.Random(seed)


class MaxScorePicker:
    """Highest total first; ties broken uniformly at random (seeded when the request is)."""

    name = "max"

    def pick(self, totals: np.ndarray, count: int, seed: int | None) -> list[int]:
        n = len(totals)
        if n == 0:
            return []
        if n == 1:
            return [0]
        # On Python floats: a numpy argsort and its scalars cost more than the whole
        # answer (issue 29). The same answer as _pick_sorted (tests/scheduler/test_pickers.py
        # compares them): each value's candidates in index order, ties shuffled by the
        # same draws. NaN has no place in a sort by value: that case keeps the old path.
        t = totals.tolist()
        total = sum(t)
        if total != total:  # a NaN (or inf - inf) somewhere
            return _pick_sorted(totals, count, seed)
        ranked = sorted(t, reverse=True)
        count = min(count, n)
        result: list[int] = []
        k = 0
        rng = None
        while len(result) < count:
            value = ranked[k]
            end = k + 1
            while end < n and ranked[end] == value:
                end += 1
            if end == k + 1:
                result.append(t.index(value))
            else:  # a tie reaching into the answer: shuffled, so that ties do not
                # always favour the lowest index
                group = [i for i, x in enumerate(t) if x == value]
                rng = rng or _rng(seed)
                rng.shuffle(group)
                result.extend(group)
            k = end
        return result[:count]


def _pick_sorted(totals: np.ndarray, count: int, seed: int | None) -> list[int]:
    """:meth:`MaxScorePicker.pick` on numpy's stable sort (any totals, NaN included:
    NaN sorts last, each one a value of its own)."""
    n = len(totals)
    order = np.argsort(-totals, kind="stable").tolist()
    count = min(count, n)
    # Shuffle each run of equal totals that reaches into the answer.
    result: list[int] = []
    start = 0
    rng = None
    while len(result) < count:
        value = totals[order[start]]
        end = start + 1
        while end < n and totals[order[end]] == value:
            end += 1
        group = order[start:end]
        if len(group) > 1:
            rng = rng or _rng(seed)
            rng.shuffle(group)
        result.extend(group)
        start = end
    return result[:count]


class WeightedRandomPicker:
    """Draw without replacement with probability proportional to the total.

    Spreads load more than ``max``; endpoints with total 0 come last, in random order.
    """

    name = "weighted-random"

    def pick(self, totals: np.ndarray, count: int, seed: int | None) -> list[int]:
        n = len(totals)
        count = min(count, n)
        rng = _rng(seed)
        # Efraimidis–Spirakis: key = u^(1/w); top keys form a weighted sample.
        keys = [
            (rng.random() ** (1.0 / w) if w > 0 else -rng.random(), i)
            for i, w in enumerate(totals.tolist())
        ]
        keys.sort(reverse=True)
        return [i for _, i in keys[:count]]


def make_picker(name: str) -> Picker:
    if name == "max":
        return MaxScorePicker()
    if name == "weighted-random":
        return WeightedRandomPicker()
    raise ValueError(f"unknown picker {name!r}; expected 'max' or 'weighted-random'")
