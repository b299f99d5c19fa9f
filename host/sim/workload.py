"""Seeded workload generators: lists of :class:`SimRequest` in arrival order.

Every generator takes ``qps`` (Poisson arrivals: exponential gaps with mean 1/qps),
``duration_s`` (arrivals in [0, duration_s)) and ``seed``; the same arguments always give
the same list. Token counts follow :mod:`epick.sim.tokens` (4 bytes per token): a
``prompt_tokens`` of 500 gives ~2,000 bytes of text. A count is either an int or an
inclusive ``(low, high)`` range drawn uniformly per request.

* :func:`multi_lora` — N adapters in groups sharing the traffic (60/30/10 by default);
  unique prompts, so only adapter placement matters.
* :func:`shared_prefix` — many tenants, each with a long system prompt shared by all its
  requests plus a short unique suffix; prefix placement matters.
* :func:`zero_hit` — unique prompts, base model: nothing to exploit (overhead baseline).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec

from .tokens import BYTES_PER_TOKEN

__all__ = ["SimRequest", "multi_lora", "shared_prefix", "zero_hit", "adapter_names"]

TokenCount = int | tuple[int, int]

# A small vocabulary of 3-letter words: with the separating space every word is exactly
# one 4-byte token, so generated text has exactly the requested token count.
_VOCAB = tuple(
    a + b + c for a in "bcdfghklmnprstvz" for b in "aeiou" for c in "bdgklmnprstx"
)


class SimRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request of a workload."""

    request_id: str
    arrival_s: float
    """Arrival time, seconds from the start of the run."""
    prompt: str
    max_tokens: int
    """Output tokens the request generates (the sim never stops early)."""
    adapter: str = ""
    """LoRA adapter; empty = the base model."""
    cache_salt: str = ""
    group: str = ""
    """The workload's label for it (adapter group, tenant), for per-group breakdowns."""


def adapter_names(n: int) -> list[str]:
    """The adapter names the generators and the servers use: ``adapter-0`` … ``adapter-{n-1}``."""
    return [f"adapter-{i}" for i in range(n)]


def _count(rng: random.Random, c: TokenCount, what: str) -> int:
    if isinstance(c, int):
        n = c
    else:
        lo, hi = c
        if lo > hi:
            raise ValueError(f"{what}: range ({lo}, {hi}) has low > high")
        n = rng.randint(lo, hi)
    if n < 1:
        raise ValueError(f"{what} must be >= 1, got {n}")
    return n


def _text(rng: random.Random, tokens: int) -> str:
    # Exactly `tokens` 4-byte tokens: words of 3 letters each followed by a space.
    return "".join(w + " " for w in rng.choices(_VOCAB, k=tokens))


def _arrivals(rng: random.Random, qps: float, duration_s: float) -> list[float]:
    if qps <= 0:
        raise ValueError(f"qps must be positive, got {qps}")
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    out: list[float] = []
    t = rng.expovariate(qps)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(qps)
    return out


def multi_lora(
    *,
    qps: float,
    duration_s: float,
    adapters: int = 15,
    split: Sequence[float] = (0.6, 0.3, 0.1),
    prompt_tokens: TokenCount = (200, 800),
    output_tokens: TokenCount = (50, 250),
    seed: int = 0,
) -> list[SimRequest]:
    """Multi-LoRA traffic (the upstream regression setup: 15 adapters, 60/30/10).

    The adapters are dealt round-robin into ``len(split)`` groups (``adapter-0`` into group
    0, ``adapter-1`` into group 1, …); a request picks a group with the ``split``
    weights, then an adapter of that group uniformly. ``group`` is ``"g0"``, ``"g1"``, ….
    """
    if adapters < len(split):
        raise ValueError(f"adapters ({adapters}) must be at least the number of groups ({len(split)})")
    if any(w < 0 for w in split) or sum(split) <= 0:
        raise ValueError(f"split must be non-negative weights with a positive sum, got {tuple(split)}")
    rng = random.Random(seed)
    names = adapter_names(adapters)
    groups = [names[g :: len(split)] for g in range(len(split))]
    out = []
    for i, t in enumerate(_arrivals(rng, qps, duration_s)):
        g = rng.choices(range(len(split)), weights=split)[0]
        out.append(SimRequest(
            request_id=f"lora-{i}", arrival_s=t,
            prompt=_text(rng, _count(rng, prompt_tokens, "prompt_tokens")),
            max_tokens=_count(rng, output_tokens, "output_tokens"),
            adapter=rng.choice(groups[g]), group=f"g{g}",
        ))
    return out


def shared_prefix(
    *,
    qps: float,
    duration_s: float,
    tenants: int = 150,
    prefix_tokens: int = 6000,
    suffix_tokens: TokenCount = (50, 200),
    output_tokens: TokenCount = (100, 300),
    seed: int = 0,
) -> list[SimRequest]:
    """Many tenants, each a long shared system prompt plus a short unique suffix (the
    llm-d precise-prefix setup: 150 tenants with 6k-token prefixes). A request's tenant
    is uniform; ``group`` is ``"tenant-<k>"``."""
    if tenants < 1:
        raise ValueError(f"tenants must be >= 1, got {tenants}")
    rng = random.Random(seed)
    prefixes = [_text(rng, _count(rng, prefix_tokens, "prefix_tokens")) for _ in range(tenants)]
    out = []
    for i, t in enumerate(_arrivals(rng, qps, duration_s)):
        k = rng.randrange(tenants)
        out.append(SimRequest(
            request_id=f"prefix-{i}", arrival_s=t,
            prompt=prefixes[k] + _text(rng, _count(rng, suffix_tokens, "suffix_tokens")),
            max_tokens=_count(rng, output_tokens, "output_tokens"),
            group=f"tenant-{k}",
        ))
    return out


def zero_hit(
    *,
    qps: float,
    duration_s: float,
    prompt_tokens: TokenCount = (200, 800),
    output_tokens: TokenCount = (50, 250),
    seed: int = 0,
) -> list[SimRequest]:
    """Unique prompts on the base model: no prefix or adapter to exploit."""
    rng = random.Random(seed)
    out = []
    for i, t in enumerate(_arrivals(rng, qps, duration_s)):
        out.append(SimRequest(
            request_id=f"zero-{i}", arrival_s=t,
            prompt=_text(rng, _count(rng, prompt_tokens, "prompt_tokens")),
            max_tokens=_count(rng, output_tokens, "output_tokens"),
            group="zero-hit",
        ))
    return out


assert BYTES_PER_TOKEN == 4, "_text assumes 4-byte tokens (3-letter word + space)"
