"""The seam the scheduler holds: per-candidate KV block counts for one Pick.

``KvRouting.counts(request, endpoints, candidates)`` → ``(prefix_blocks, prefix_matched)``,
one entry per candidate (``ScoreInput.prefix_blocks`` / ``prefix_matched``), and
``KvRouting.cleared`` → when each candidate's index was last emptied
(``ScoreInput.prefix_cleared_ms``): the request's
full blocks as that endpoint's engine hashes them (its block size as its events carry
it, else as its ``cache_config_info`` reports it; the adapter's path on that endpoint), and how many leading ones its
own KV events say it holds (-1 = no event stream, or its index is uncertain).

Cost is bounded: the prompt is tokenized once per distinct (prompt) and hashed once per
distinct (block size, adapter path, salt) — both kept in small LRU caches, so N
candidates and M policies of one cycle (and a retry of the same prompt) pay once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from epick import abi
from epick.kv.hashing import BlockHasher
from epick.kv.index import KvIndex
from epick.kv.tokenize import Tokenizer

__all__ = ["KvRouting"]


class _Lru(OrderedDict):
    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def put(self, key, value):
        self[key] = value
        if len(self) > self.cap:
            self.popitem(last=False)
        return value


class KvRouting:
    def __init__(
        self,
        index: KvIndex,
        tokenizer: Tokenizer,
        hasher: BlockHasher,
        *,
        block_size: int = 0,
        lora_paths: Mapping[str, str] | None = None,
        cache_entries: int = 256,
    ) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.hasher = hasher
        self.block_size = block_size
        """Overrides every endpoint's reported block size when > 0."""
        self.lora_paths = dict(lora_paths or {})
        """Adapter name → path for every endpoint (config); per endpoint wins."""
        self.endpoint_lora_paths: dict[str, dict[str, str]] = {}
        """Per endpoint: adapter name → the path its engine loaded it from (/v1/models)."""
        self._tokens = _Lru(cache_entries)
        self._hashes = _Lru(cache_entries)

    def set_lora_paths(self, address: str, paths: dict[str, str]) -> None:
        self.endpoint_lora_paths[address] = paths

    def forget(self, address: str) -> None:
        self.endpoint_lora_paths.pop(address, None)

    def tokens(self, prompt: str) -> list[int]:
        got = self._tokens.get(prompt)
        if got is None:
            got = self._tokens.put(prompt, self.tokenizer.encode_pick(prompt))
        else:
            self._tokens.move_to_end(prompt)
        return got

    def hashes(self, prompt: str, block_size: int, adapter: str, path: str,
               salt: str) -> list[int]:
        key = (prompt, block_size, adapter, path, salt)
        got = self._hashes.get(key)
        if got is None:
            got = self._hashes.put(key, self.hasher.block_hashes(
                self.tokens(prompt), block_size, lora_name=adapter or None,
                lora_path=path or None, cache_salt=salt or None))
        else:
            self._hashes.move_to_end(key)
        return got

    def counts(
        self,
        request: abi.Request,
        endpoints: Sequence[abi.EndpointMetrics],
        candidates: Sequence[int],
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        blocks: list[int] = []
        matched: list[int] = []
        adapter = request.adapter
        for i in candidates:
            ep = endpoints[i]
            # Config override, else what its events carry, else what its metrics report.
            bs = self.block_size or self.index.block_size(ep.address) or ep.block_size
            if bs <= 0:  # geometry unknown: nothing can be matched
                blocks.append(0)
                matched.append(-1)
                continue
            path = ""
            if adapter:
                path = (self.endpoint_lora_paths.get(ep.address, {}).get(adapter)
                        or self.lora_paths.get(adapter, ""))
            hashes = self.hashes(request.prompt, bs, adapter, path, request.cache_salt)
            blocks.append(len(hashes))
            matched.append(self.index.matched(ep.address, hashes))
        return tuple(blocks), tuple(matched)

    def cleared(self, endpoints: Sequence[abi.EndpointMetrics],
                candidates: Sequence[int]) -> tuple[int, ...]:
        """Per candidate: ms when its index was last emptied (0 = never)."""
        return tuple(self.index.cleared_ms(endpoints[i].address) for i in candidates)
