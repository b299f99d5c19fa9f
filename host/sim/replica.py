"""One simulated vLLM replica: continuous batching over a paged, prefix-cached KV cache.

Pure logic: no I/O, no clock. A driver calls :meth:`Replica.submit` with the arrival time,
asks :meth:`Replica.next_event_time` when the replica next needs attention, and calls
:meth:`Replica.advance` with the current time; the replica runs every engine step that
has ended by then and reports tokens and completions. The same object serves the
virtual-time fleet (:mod:`epick.sim.fleet`) and the HTTP servers (:mod:`epick.sim.server`).

The engine follows vLLM v1's scheduler, one step at a time:

1. A request enters the *waiting* queue ``frontend_overhead_s`` after it is submitted.
2. At the start of a step, running requests are scheduled first, in order, each for the
   tokens it still has to compute (1 when decoding, the rest of its prompt when
   prefilling), cut to the step's token budget (chunked prefill). A request whose new
   tokens need KV blocks that are not free preempts the *last* running request (its
   blocks are released, it goes back to the front of the waiting queue and later
   recomputes prompt + output so far, hitting its own cached blocks if still there).
3. If nothing was preempted, waiting requests are admitted in FCFS order while the batch
   has room (``max_num_seqs``) and budget is left. One whose adapter has no slot is
   skipped (it stays waiting: its adapter is a *waiting* LoRA adapter); one whose blocks
   do not fit stops admission. An admitted request first takes the longest run of its
   prompt's cached blocks (automatic prefix caching; at least one token is always
   recomputed) and only computes the rest.
4. The step lasts ``decode_step_base_s + per_context_token_s × (context tokens in the
   batch) + prefill tokens / prefill_tokens_per_s + adapter load time``. When it ends,
   every request that has computed all its known tokens emits one output token; one that
   reaches ``max_tokens`` finishes and releases its blocks (hashed prompt blocks stay
   cached) and its adapter.

What the engine reports for ``/metrics`` besides the counts (vLLM 0.32, read in
``vllm/v1/core/sched/scheduler.py`` and ``vllm/v1/metrics/stats.py``):

* *deferred* requests: waiting ones the scheduler skipped for want of a LoRA slot; a
  request stays deferred until it is admitted (vLLM's ``deferred_waiting`` set);
* *tracked adapters* (:meth:`Replica.lora_adapters`): vLLM's ``LoRARequestStates`` — an
  adapter is listed from the first admission of one of its requests until the last such
  request finishes or is aborted (a preempted one stays listed), in first-listed order.
  Requests never admitted (deferred, or queued for capacity) are not listed;
* sleep (:meth:`Replica.sleep`): vLLM's ``/sleep?level=N`` with its default mode
  ``abort`` — every request in flight is aborted, level >= 1 clears the prefix cache, and
  nothing is scheduled until :meth:`Replica.wake_up`; requests submitted meanwhile wait.

KV-cache events (``Replica(config, kv_events=sink)``), as vLLM publishes them with
``--kv-events-config``: the blocks a step caches become one ``BlockStored`` per request
and contiguous run (``block_hashes`` = vLLM's sha256 block hashes over the sim's token
ids — :func:`epick.sim.tokens.token_ids`, :class:`epick.kv.hashing.BlockHasher` with the
adapter as ``lora_name`` and the cache salt — ``parent_block_hash``, the blocks'
``token_ids``, ``block_size``, ``lora_id``/``lora_name``, ``medium`` "GPU",
``extra_keys``); an evicted cached block is a ``BlockRemoved``; a reset of the prefix cache
(sleep level >= 1) is ``AllBlocksCleared``. ``sink(events)`` gets each step's events (one
vLLM batch) when the step starts, and a sleep's at once; the driver stamps and delivers
them. The sim's own cache keys stay its internal hashes: events change no decision.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from .config import ReplicaConfig
from .kv import KVCache
from .lora import LoraSlots
from .tokens import block_hashes, count_tokens, token_ids

__all__ = ["Replica", "EngineRequest", "Status", "StepOutput", "RequestRejected"]


class RequestRejected(ValueError):
    """The request can never run on this replica (too long for the model or the KV cache)."""


class Status(Enum):
    PENDING = "pending"  # in the frontend, not yet in the engine
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True, eq=False)
class EngineRequest:
    """A request inside one replica; drivers read its progress fields."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    adapter: str
    block_hashes: list[int]
    submitted_at: float
    ready_at: float
    handle: object = None
    """Whatever the driver attached (its request record, a stream); never read here."""
    status: Status = Status.PENDING
    num_computed: int = 0
    output_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    registered: int = 0
    cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first admission (-1 before)."""
    adapter_loads: int = 0
    """Adapter loads its admissions caused (0 or 1, more after preemptions)."""
    preemptions: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    deferred: bool = False
    """Skipped by the scheduler for want of a LoRA slot, not admitted since."""
    tracked: bool = False
    """Admitted at least once: its adapter is listed by :meth:`Replica.lora_adapters`."""
    event_hashes: list[int] = field(default_factory=list)
    """With KV events on: the published (vLLM) hash of each block in ``block_hashes``."""
    token_ids: list[int] = field(default_factory=list)
    """With KV events on: the prompt's token ids (for ``BlockStored.token_ids``)."""
    cache_salt: str = ""

    @property
    def num_tokens(self) -> int:
        """Tokens known so far: prompt plus output."""
        return self.prompt_tokens + self.output_tokens


@dataclass(slots=True)
class StepOutput:
    """What :meth:`Replica.advance` reports: who got a token, who finished, and when."""

    emitted: list[tuple[EngineRequest, int, float]] = field(default_factory=list)
    """(request, token number counted from 1, time) for every output token produced,
    in time order."""
    finished: list[EngineRequest] = field(default_factory=list)


class Replica:
    """The engine of one replica. See the module docstring for the model."""

    def __init__(self, config: ReplicaConfig, *, report_tokens: bool = True,
                 kv_events: Callable[[list], None] | None = None) -> None:
        self.config = config
        self.report_tokens = report_tokens
        """Fill :attr:`StepOutput.emitted` (streaming drivers); off, only completions
        are reported, which saves a tuple per generated token."""
        self.kv_events = kv_events
        """Where each step's KV-cache events go (see the module docstring); None = off."""
        self.kv = KVCache(config.num_gpu_blocks, publish=kv_events is not None)
        self._hasher = None
        self._lora_ids: dict[str, int] = {}
        if kv_events is not None:
            from epick.kv.hashing import BlockHasher

            self._hasher = BlockHasher()  # vLLM's default: sha256, no PYTHONHASHSEED
        self.lora = LoraSlots(
            config.max_loras, config.cpu_lora_capacity,
            config.lora_load_host_s, config.lora_load_disk_s,
        )
        self._pending: list[tuple[float, int, EngineRequest]] = []
        self._seq = 0
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._requests: dict[str, EngineRequest] = {}
        self._step_end: float | None = None
        self._step: list[tuple[EngineRequest, int]] = []
        self.last_step_at = 0.0
        """Start time of the most recent step."""
        self.stats_at = 0.0
        """Time of the most recent step start or end: when vLLM last recorded its
        scheduler stats (it records once per engine step)."""
        self.steps = 0
        self.preemptions = 0
        self.prompt_tokens_queried = 0
        self.prompt_tokens_cached = 0
        self.generation_tokens = 0
        self.finished = 0
        """Requests that finished (all by length: the sim never stops early)."""
        self.aborted = 0
        """Requests aborted (client gone, or put to sleep)."""
        self.num_deferred = 0
        """Waiting requests deferred for want of a LoRA slot (see the module docstring)."""
        self._tracked: dict[str, int] = {}
        self.sleep_level: int | None = None
        """``None`` when awake, else the level of :meth:`sleep` (0, 1 or 2)."""

    # --- driver API -------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt: str,
        max_tokens: int,
        now: float,
        *,
        adapter: str = "",
        cache_salt: str = "",
        handle: object = None,
    ) -> EngineRequest:
        """Accept a request arriving at ``now``; it reaches the engine queue later.

        Raises
        ------
        RequestRejected
            The prompt plus ``max_tokens`` exceeds ``max_model_len`` or the KV cache, or
            the request names an adapter while LoRA is disabled.
        ValueError
            ``request_id`` is already in flight here, or ``max_tokens`` < 1.
        """
        cfg = self.config
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in flight on this replica")
        if adapter and cfg.max_loras == 0:
            raise RequestRejected(f"request {request_id!r} names adapter {adapter!r} but LoRA is disabled (max_loras=0)")
        n_prompt = max(1, count_tokens(prompt))
        total = n_prompt + max_tokens
        if total > cfg.max_model_len:
            raise RequestRejected(
                f"request {request_id!r}: prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) "
                f"= {total} exceeds max_model_len {cfg.max_model_len}"
            )
        if -(-total // cfg.block_size) > cfg.num_gpu_blocks:
            raise RequestRejected(
                f"request {request_id!r}: {total} tokens need more than the {cfg.num_gpu_blocks} KV blocks"
            )
        hashes = (
            block_hashes(prompt, cfg.block_size, adapter=adapter, cache_salt=cache_salt)
            if cfg.enable_prefix_caching else []
        )
        req = EngineRequest(
            request_id=request_id, prompt_tokens=n_prompt, max_tokens=max_tokens,
            adapter=adapter, block_hashes=hashes, submitted_at=now,
            ready_at=now + cfg.frontend_overhead_s, handle=handle,
        )
        if self._hasher is not None and hashes:
            req.cache_salt = cache_salt
            req.token_ids = token_ids(prompt)
            # The published chain covers the same blocks as the internal one (a prompt
            # ending in a partial token may give the tokens one more full block: never
            # cached here, so never published).
            req.event_hashes = self._hasher.block_hashes(
                req.token_ids[: len(hashes) * cfg.block_size], cfg.block_size,
                lora_name=adapter or None, cache_salt=cache_salt or None)
        self._requests[request_id] = req
        self._seq += 1
        heapq.heappush(self._pending, (req.ready_at, self._seq, req))
        return req

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (client went away); False if not in flight."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is Status.PENDING:
            self._pending = [e for e in self._pending if e[2] is not req]
            heapq.heapify(self._pending)
        elif req.status is Status.WAITING:
            self._waiting.remove(req)
            self._undefer(req)
        elif req.status is Status.RUNNING:
            self._running.remove(req)
            self._release(req)
        self._untrack(req)
        req.status = Status.ABORTED
        self.aborted += 1
        return True

    def sleep(self, level: int = 1) -> list[EngineRequest]:
        """Put the engine to sleep as vLLM's ``POST /sleep?level=N`` (mode ``abort``) does.

        Every request in flight is aborted and returned (the driver ends their streams);
        level >= 1 also clears the prefix cache (weights offloaded, KV discarded). Until
        :meth:`wake_up` nothing is scheduled: requests submitted meanwhile wait.

        Raises ``ValueError`` for a level other than 0, 1 or 2.
        """
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}")
        aborted = list(self._requests.values())
        for req in aborted:
            self.abort(req.request_id)
        self._step = []
        self._step_end = None
        if level >= 1:
            self.kv.reset_prefix_cache()
        self.sleep_level = level
        self._flush_events()
        return aborted

    def _flush_events(self) -> None:
        events = self.kv.events
        if events:
            self.kv.events = []
            self.kv_events(events)  # type: ignore[misc]

    def wake_up(self) -> None:
        """Resume scheduling (vLLM's ``POST /wake_up``); the next :meth:`advance` runs."""
        self.sleep_level = None

    def next_event_time(self) -> float | None:
        """When :meth:`advance` next has work: the end of the running step, else the next
        request to clear the frontend; ``None`` when idle."""
        if self.sleep_level is not None:
            return None
        if self._step_end is not None:
            return self._step_end
        if self._pending:
            return self._pending[0][0]
        return None

    def advance(self, now: float) -> StepOutput:
        """Run every step that ends at or before ``now``; start the next one if work is left."""
        out = StepOutput()
        while True:
            t = self.next_event_time()
            if t is None or t > now:
                return out
            if self._step_end is not None:
                self._finish_step(t, out)
            self._admit_ready(t)
            self._start_step(t)

    # --- what metrics report -------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """``vllm:num_requests_waiting``: the engine's queue (preempted and LoRA-blocked
        requests included, the frontend not)."""
        return len(self._waiting)

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def running_adapters(self) -> list[str]:
        """Adapters of running requests, in order of first appearance (as vLLM's dict keys)."""
        return list(dict.fromkeys(r.adapter for r in self._running if r.adapter))

    def waiting_adapters(self) -> list[str]:
        """Adapters of waiting requests, in order of first appearance."""
        return list(dict.fromkeys(r.adapter for r in self._waiting if r.adapter))

    def lora_adapters(self) -> list[str]:
        """Adapters current vLLM lists in both ``running_lora_adapters`` and
        ``waiting_lora_adapters``: those with an in-flight request admitted at least once,
        in the order vLLM's ``LoRARequestStates`` dict holds them."""
        return list(self._tracked)

    def _untrack(self, req: EngineRequest) -> None:
        if req.tracked:
            req.tracked = False
            n = self._tracked[req.adapter] - 1
            if n:
                self._tracked[req.adapter] = n
            else:
                del self._tracked[req.adapter]

    def _undefer(self, req: EngineRequest) -> None:
        if req.deferred:
            req.deferred = False
            self.num_deferred -= 1

    # --- the engine --------------------------------------------------------------------

    def _admit_ready(self, t: float) -> None:
        pending = self._pending
        while pending and pending[0][0] <= t:
            req = heapq.heappop(pending)[2]
            req.status = Status.WAITING
            self._waiting.append(req)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _start_step(self, t: float) -> None:
        sched, load_s, preempted = self._schedule()
        if not sched and preempted:
            # Everything running was preempted: admission was skipped this round (vLLM
            # admits nothing in a step that preempted); the queue gets the next round now.
            sched, load_s, _ = self._schedule()
        if self.kv.events:
            self._flush_events()
        if not sched:
            self._step_end = None
            return
        cfg = self.config
        ctx = 0
        prefill = 0
        for req, n in sched:
            ctx += req.num_computed + n
            if n > 1:
                prefill += n
        duration = (
            cfg.decode_step_base_s
            + ctx * cfg.per_context_token_s
            + prefill / cfg.prefill_tokens_per_s
            + load_s
        )
        self._step = sched
        self._step_end = t + duration
        self.last_step_at = t
        self.stats_at = t
        self.steps += 1

    def _schedule(self) -> tuple[list[tuple[EngineRequest, int]], float, bool]:
        cfg = self.config
        kv = self.kv
        budget = cfg.max_num_batched_tokens
        sched: list[tuple[EngineRequest, int]] = []
        running = self._running
        preempted = False
        bs = cfg.block_size
        i = 0
        # The hot loop of a run (every running request, every step): kept plain.
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.prompt_tokens + req.output_tokens - req.num_computed
            if n > budget:
                n = budget
            total = req.num_computed + n
            need = -(-total // bs) - len(req.blocks)
            if need > 0:
                while need > kv.num_free:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                if req.status is not Status.RUNNING:
                    break
                req.blocks.extend(kv.allocate(need))
            if req.registered < len(req.block_hashes):
                self._register(req, total)
            sched.append((req, n))
            budget -= n
            i += 1

        load_s = 0.0
        if preempted:
            return sched, load_s, True

        waiting = self._waiting
        skipped: list[EngineRequest] = []
        lora = self.lora
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            req = waiting[0]
            if req.adapter and not lora.can_start(req.adapter):
                if not req.deferred:
                    req.deferred = True
                    self.num_deferred += 1
                skipped.append(waiting.popleft())
                continue
            hits: list[int] = []
            if req.block_hashes:
                hits = kv.match_prefix(req.block_hashes, (req.num_tokens - 1) // bs)
            computed = len(hits) * bs
            n = min(req.num_tokens - computed, budget)
            need = self._blocks_for(computed + n) - len(hits)
            if kv.free_needed_for(hits, need) > kv.num_free:
                break
            waiting.popleft()
            self._undefer(req)
            kv.take(hits)
            req.blocks = hits + kv.allocate(need)
            req.num_computed = computed
            req.registered = len(hits)
            if req.cached_tokens < 0:
                req.cached_tokens = computed
                self.prompt_tokens_queried += req.prompt_tokens
                self.prompt_tokens_cached += computed
            if req.adapter:
                loads = lora.loads
                load_s += lora.acquire(req.adapter)
                req.adapter_loads += lora.loads - loads
                if not req.tracked:
                    req.tracked = True
                    self._tracked[req.adapter] = self._tracked.get(req.adapter, 0) + 1
            self._register(req, computed + n)
            req.status = Status.RUNNING
            running.append(req)
            sched.append((req, n))
            budget -= n
        if skipped:
            waiting.extendleft(reversed(skipped))
        return sched, load_s, False

    def _register(self, req: EngineRequest, tokens: int) -> None:
        """Publish the prompt blocks that ``tokens`` computed tokens fill completely."""
        hashes = req.block_hashes
        full = min(tokens // self.config.block_size, len(hashes))
        if req.event_hashes:
            self._register_published(req, full)
        else:
            for j in range(req.registered, full):
                self.kv.register(req.blocks[j], hashes[j])
        if full > req.registered:
            req.registered = full

    def _register_published(self, req: EngineRequest, full: int) -> None:
        """:meth:`_register` with KV events: a ``BlockStored`` per run of newly cached
        blocks (a block another request cached first breaks the run)."""
        kv, hashes, pub = self.kv, req.block_hashes, req.event_hashes
        start = None
        for j in range(req.registered, full):
            if kv.register(req.blocks[j], hashes[j], pub[j]):
                if start is None:
                    start = j
            elif start is not None:
                self._stored(req, start, j)
                start = None
        if start is not None:
            self._stored(req, start, full)

    def _stored(self, req: EngineRequest, start: int, end: int) -> None:
        from epick.kv.events import BlockStored

        bs = self.config.block_size
        pub = req.event_hashes
        lora_id = None
        if req.adapter:
            lora_id = self._lora_ids.setdefault(req.adapter, len(self._lora_ids) + 1)
        # vLLM's extra_keys per block: the adapter on every block, the salt on block 0.
        salt = req.cache_salt
        extra = [tuple(k for k in (req.adapter, salt if j == 0 else "") if k) or None
                 for j in range(start, end)]
        self.kv.events.append(BlockStored(  # type: ignore[union-attr]
            block_hashes=pub[start:end],
            parent_block_hash=pub[start - 1] if start else None,
            token_ids=req.token_ids[start * bs:end * bs], block_size=bs, lora_id=lora_id,
            medium="GPU", lora_name=req.adapter or None, extra_keys=extra, group_idx=0,
            kv_cache_spec_kind="full_attention",
        ))

    def _preempt(self, req: EngineRequest) -> None:
        self._release(req)
        req.num_computed = 0
        req.registered = 0
        req.preemptions += 1
        req.status = Status.WAITING
        self.preemptions += 1
        self._waiting.appendleft(req)

    def _release(self, req: EngineRequest) -> None:
        self.kv.release(req.blocks)
        req.blocks = []
        if req.adapter:
            self.lora.release(req.adapter)

    def _finish_step(self, t: float, out: StepOutput) -> None:
        sched = self._step
        self._step = []
        self._step_end = None
        self.stats_at = t
        finished = False
        emitted = out.emitted if self.report_tokens else None
        tokens = 0
        for req, n in sched:
            if req.status is not Status.RUNNING:
                continue  # aborted while the step ran
            req.num_computed += n
            if req.num_computed < req.prompt_tokens + req.output_tokens:
                continue  # a prefill chunk: no token yet
            req.output_tokens += 1
            tokens += 1
            if req.first_token_at is None:
                req.first_token_at = t
            if emitted is not None:
                emitted.append((req, req.output_tokens, t))
            if req.output_tokens >= req.max_tokens:
                req.status = Status.FINISHED
                req.finished_at = t
                self._release(req)
                self._untrack(req)
                del self._requests[req.request_id]
                out.finished.append(req)
                self.finished += 1
                finished = True
        self.generation_tokens += tokens
        if finished:
            self._running = [r for r in self._running if r.status is Status.RUNNING]
