"""The three default policies written in plain Python, as scheduler plugins.

They exist for ``epick bench pick`` (WASM vs Python, side by side, same scheduler) and
as readable references; the shipped policies are the WASM modules in policies/. Same
score tables as DESIGN.md; the Python versions keep their state in dicts and re-read
the decoded snapshot objects on every call (no msgpack).
"""

from __future__ import annotations

import struct
from collections import OrderedDict

import numpy as np
import xxhash

from epick import abi
from epick.scheduler.framework import Cycle

__all__ = ["PyLoad", "PyLoraAffinity", "PyPrefixCache"]


class PyLoad:
    """queue score (max−q)/(max−min), kv score 1−kv, combined by weights."""

    is_filter = False
    is_scorer = True
    has_pre_request = False
    has_post_response = False

    def __init__(self, name: str = "load", queue_weight: float = 1.0, kv_weight: float = 1.0):
        self.name = name
        self.wq, self.wkv = queue_weight, kv_weight

    def score(self, cycle: Cycle, candidates: tuple[int, ...]) -> np.ndarray:
        eps = cycle.pool.snapshot.endpoints
        q = np.array([eps[i].waiting for i in candidates], dtype=float)
        kv = np.array([eps[i].kv_usage for i in candidates], dtype=float)
        lo, hi = (q.min(), q.max()) if len(q) else (0.0, 0.0)
        qs = np.ones_like(q) if hi == lo else (hi - q) / (hi - lo)
        kvs = 1.0 - np.clip(kv, 0.0, 1.0)
        return (self.wq * qs + self.wkv * kvs) / (self.wq + self.wkv)


class PyLoraAffinity:
    """The seed table (1 / 0.75 / 0–0.5 / 0) with pre/post request history."""

    is_filter = False
    is_scorer = True
    has_pre_request = True
    has_post_response = True

    def __init__(self, name: str = "lora-affinity"):
        self.name = name
        self.history: dict[tuple[str, str], int] = {}

    def score(self, cycle: Cycle, candidates: tuple[int, ...]) -> np.ndarray:
        adapter = cycle.request.adapter
        if not adapter:
            return np.ones(len(candidates))
        eps = cycle.pool.snapshot.endpoints
        out = np.zeros(len(candidates))
        for k, i in enumerate(candidates):
            e = eps[i]
            running = set(e.running_adapters)
            running.update(a for (a, ep), n in self.history.items() if ep == e.address and n > 0)
            waiting = set(e.waiting_adapters)
            m = e.max_lora
            if adapter in running and not waiting:
                out[k] = 1.0
            elif len(running | waiting) < m:
                out[k] = 0.75
            elif waiting and m > 0:
                out[k] = 0.5 * (1 - min(len(waiting), m) / m)
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
    """DESIGN.md's chained xxh64 block hashes and a per-endpoint LRU."""

    is_filter = False
    is_scorer = True
    has_pre_request = True
    has_post_response = False

    def __init__(self, name: str = "prefix-cache", block_size: int = 64, max_blocks: int = 256,
                 lru_capacity: int = 31_250):
        self.name = name
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
        eps = cycle.pool.snapshot.endpoints
        for k, i in enumerate(candidates):
            lru = self.lru.get(eps[i].address)
            if not lru:
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
