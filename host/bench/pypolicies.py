"""The three default policies written in plain Python, as scheduler plugins.

They exist for ``epick bench pick`` (WASM vs Python, side by side, same scheduler) and
as readable references; the shipped policies are the WASM modules in policies/. Same
score tables (docs/scoring.md); the Python versions keep their state in dicts and re-read
the decoded snapshot objects on every call (no msgpack).

They stay in the package, beside the benchmark they are half of (an installed
``epick bench pick`` needs them); the scheduler tests reuse them as real plugins rather
than keep a second copy under tests/.
"""

from __future__ import annotations

import math
import struct
import time
from collections import OrderedDict

import numpy as np
import xxhash

from epick import abi
from epick.interfaces import Capabilities, Cycle

__all__ = ["PyLoad", "PyLoraAffinity", "PyPrefixCache", "work"]


def work(cycle: Cycle, candidates: tuple[int, ...]) -> np.ndarray:
    """The SDK's ``ctx.work``: max(running + waiting + unseen, in_flight), unseen = the
    picks since the scrape that are still in flight."""
    eps = cycle.view.snapshot.endpoints
    a = cycle.assignments
    out = np.empty(len(candidates))
    for k, i in enumerate(candidates):
        e = eps[i]
        inflight = a.in_flight(e.address) if a else 0
        unseen = min(a.picked_since_scrape(e.address), inflight) if a else 0
        out[k] = max(max(e.running, 0) + max(e.waiting, 0) + unseen, inflight)
    return out


class PyLoad:
    """queue score (max−q)/(max−min), kv score 1−kv, work score s/(s+w), by weights; for
    base-model requests a replica picked ``age`` ms ago counts
    ``recent_requests · e^(−age / recent_ms)`` more requests of work (the clock: the later
    of the snapshot's time and the latest pick)."""

    capabilities = Capabilities.SCORE | Capabilities.PRE_REQUEST

    def __init__(self, name: str = "load", queue_weight: float = 1.0, kv_weight: float = 1.0,
                 work_weight: float = 2.0, work_scale: float = 8.0,
                 recent_requests: float = 8.0, recent_ms: float = 45.0):
        self.name = name
        self.wq, self.wkv, self.ww, self.scale = queue_weight, kv_weight, work_weight, work_scale
        self.recent_n, self.recent_ms = recent_requests, recent_ms
        self.last_pick: dict[str, int] = {}
        self.latest_ms = -(2**63)

    def pre_request(self, cycle: Cycle, endpoint: str) -> None:
        t = cycle.now_ms or int(time.time() * 1000)
        self.latest_ms = max(self.latest_ms, t)
        if self.recent_n and endpoint:
            self.last_pick[endpoint] = max(self.last_pick.get(endpoint, t), t)

    def score(self, cycle: Cycle, candidates: tuple[int, ...]) -> np.ndarray:
        eps = cycle.view.snapshot.endpoints
        q = np.array([eps[i].waiting for i in candidates], dtype=float)
        kv = np.array([eps[i].kv_usage for i in candidates], dtype=float)
        lo, hi = (q.min(), q.max()) if len(q) else (0.0, 0.0)
        qs = np.ones_like(q) if hi == lo else (hi - q) / (hi - lo)
        kvs = 1.0 - np.clip(kv, 0.0, 1.0)
        w = work(cycle, candidates)
        if self.recent_n and not cycle.request.adapter and self.last_pick:
            now = max(self.latest_ms, cycle.view.snapshot.timestamp_ms)
            for k, i in enumerate(candidates):
                t = self.last_pick.get(eps[i].address)
                if t is not None:
                    w[k] += self.recent_n * math.exp(-max(now - t, 0) / self.recent_ms)
        ws = self.scale / (self.scale + w)
        return (self.wq * qs + self.wkv * kvs + self.ww * ws) / (self.wq + self.wkv + self.ww)


class PyLoraAffinity:
    """The seed table (1 / 0.75 / 0–0.5 / 0) with pre/post request history."""

    capabilities = Capabilities.SCORE | Capabilities.PRE_REQUEST | Capabilities.POST_RESPONSE

    def __init__(self, name: str = "lora-affinity", max_imbalance: int = 16):
        self.name = name
        self.max_imbalance = max_imbalance
        self.history: dict[tuple[str, str], int] = {}

    def score(self, cycle: Cycle, candidates: tuple[int, ...]) -> np.ndarray:
        adapter = cycle.request.adapter
        if not adapter:
            return np.ones(len(candidates))
        eps = cycle.view.snapshot.endpoints
        out = np.zeros(len(candidates))
        load = work(cycle, candidates)
        for k, i in enumerate(candidates):
            e = eps[i]
            running = set(e.running_adapters)
            history = {a for (a, ep), n in self.history.items() if ep == e.address and n > 0}
            waiting = set(e.waiting_adapters)
            deferring = e.deferred > 0  # history the engine does not list is what waits
            in_r = adapter in running or (adapter in history and not deferring)
            w = len(waiting)
            anonymous = 0
            if deferring:
                w += len(history - running - waiting)
                if w == 0:
                    anonymous = w = 1
            m = e.max_lora
            if in_r and w == 0:
                out[k] = 1.0
            elif len(running | waiting | history) + anonymous < m:
                out[k] = 0.75
            elif w > 0 and m > 0:
                out[k] = 0.5 * (1 - min(w, m) / m)
            if (out[k] > 0.75 and self.max_imbalance >= 0
                    and load[k] - load.min() > self.max_imbalance):
                out[k] = 0.75
        return out

    def pre_request(self, cycle: Cycle, endpoint: str) -> None:
        if cycle.request.adapter:
            key = (cycle.request.adapter, endpoint)
            self.history[key] = self.history.get(key, 0) + 1

    def post_response(self, event: abi.PostResponseEvent) -> None:
        key = (event.adapter, event.endpoint)
        if self.history.get(key, 0) > 0:
            self.history[key] -= 1


class PyPrefixCache:
    """docs/scoring.md's chained xxh64 block hashes and a per-endpoint LRU."""

    capabilities = Capabilities.SCORE | Capabilities.PRE_REQUEST

    def __init__(self, name: str = "prefix-cache", block_size: int = 64, max_blocks: int = 256,
                 lru_capacity: int = 31_250, max_imbalance: int = 8):
        self.name = name
        self.max_imbalance = max_imbalance
        self.block_size, self.max_blocks, self.capacity = block_size, max_blocks, lru_capacity
        self.lru: dict[str, OrderedDict[int, None]] = {}
        self._last: tuple[str, list[int]] = ("", [])

    def hashes(self, request: abi.Request) -> list[int]:
        if self._last[0] == request.request_id and request.request_id:
            return self._last[1]
        data = request.prompt.encode()
        bs = self.block_size
        n = min(len(data) // bs, self.max_blocks)
        out: list[int] = []
        prev = None
        for b in range(n):
            block = data[b * bs:(b + 1) * bs]
            if prev is None:
                salt = request.cache_salt.encode()
                salted = b"\0" + salt + b"\0" if salt else b""
                h = xxhash.xxh64_intdigest(request.model.encode() + salted + block)
            else:
                h = xxhash.xxh64_intdigest(block + struct.pack("<Q", prev))
            out.append(h)
            prev = h
        self._last = (request.request_id, out)
        return out

    def score(self, cycle: Cycle, candidates: tuple[int, ...]) -> np.ndarray:
        hashes = self.hashes(cycle.request)
        out = np.zeros(len(candidates))
        if not hashes:
            return out
        eps = cycle.view.snapshot.endpoints
        w = work(cycle, candidates)
        for k, i in enumerate(candidates):
            lru = self.lru.get(eps[i].address)
            if not lru or (self.max_imbalance >= 0 and w[k] - w.min() > self.max_imbalance):
                continue
            matched = 0
            for h in hashes:
                if h not in lru:
                    break
                matched += 1
            out[k] = matched / len(hashes)
        return out

    def pre_request(self, cycle: Cycle, endpoint: str) -> None:
        lru = self.lru.setdefault(endpoint, OrderedDict())
        for h in self.hashes(cycle.request):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)
