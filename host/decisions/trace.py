"""A decision log as a workload for the simulated fleet (`epick bench quality --trace`).

A replay keeps the recorded pool fixed, so it cannot say how queues and caches would
have reacted to different picks. The simulator can: :func:`load_trace` turns a log's
requests (arrival times, prompts as stand-in blocks, adapters, salts, output lengths from
the completions) into :class:`epick.sim.workload.SimRequest`s, and :func:`policy_set`
builds the recorded policy set — or a changed one — from the modules the log embeds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from epick.decisions import features, schema
from epick.decisions.reader import log_files, read_file
from epick.decisions.replay import Changes, ReplayError

__all__ = ["Trace", "load_trace", "policy_set"]

@dataclass
class Trace:
    requests: list
    """SimRequests in arrival order (seconds from the first decision)."""
    replicas: int
    """Endpoints in the largest recorded snapshot."""
    max_lora: int
    """The largest ``max_lora`` any endpoint reported (0: no LoRA)."""
    policies: tuple[schema.PolicyRef, ...]
    """The first recorded policy set."""
    modules: dict[str, bytes]
    block_bytes: int
    completions: int
    """Requests whose output length came from their completion record."""


def load_trace(paths: Iterable[str | Path], *, default_max_tokens: int = 64) -> Trace:
    """Read the logs at ``paths`` into a :class:`Trace` (``ReplayError`` if unusable)."""
    from epick import abi
    from epick.sim.workload import SimRequest

    snap_decoder = msgspec.msgpack.Decoder(abi.Snapshot)
    decisions: list[schema.DecisionRec] = []
    tokens: dict[str, int] = {}
    modules: dict[str, bytes] = {}
    policies: tuple[schema.PolicyRef, ...] | None = None
    replicas = max_lora = 0
    block_bytes = 64
    for f in log_files(paths):
        for rec in read_file(f):
            if isinstance(rec, schema.DecisionRec):
                decisions.append(rec)
            elif isinstance(rec, schema.CompletionRec):
                if rec.completion_tokens:
                    tokens[rec.id] = rec.completion_tokens
            elif isinstance(rec, schema.SnapshotRec):
                snap = snap_decoder.decode(rec.encoded)
                replicas = max(replicas, len(snap.endpoints))
                max_lora = max([max_lora, *(e.max_lora for e in snap.endpoints)])
            elif isinstance(rec, schema.Policies) and policies is None:
                policies = rec.entries
            elif isinstance(rec, schema.Module):
                modules.setdefault(rec.sha256, rec.wasm)
            elif isinstance(rec, schema.Header):
                block_bytes = rec.block_bytes
    if not decisions or policies is None:
        raise ReplayError("the log holds no decisions: nothing to simulate")
    t0 = decisions[0].t_ms
    out = []
    for d in decisions:
        r = d.request
        if r.prompt is not None:
            prompt = r.prompt
        else:
            prompt = features.synthetic_prompt(features.unpack_hashes(r.blocks), block_bytes,
                                               r.prompt_bytes, tail=d.id)
        out.append(SimRequest(
            request_id=d.id, arrival_s=max(0.0, (d.t_ms - t0) / 1000.0), prompt=prompt,
            max_tokens=tokens.get(d.id, default_max_tokens), adapter=r.adapter,
            cache_salt=r.cache_salt, group=r.adapter or "base"))
    out.sort(key=lambda s: s.arrival_s)
    return Trace(requests=out, replicas=replicas, max_lora=max_lora, policies=policies,
                 modules=modules, block_bytes=block_bytes,
                 completions=sum(1 for d in decisions if d.id in tokens))


def policy_set(runtime, trace: Trace, changes: Changes | None = None):
    """The trace's recorded policy set, with ``changes``, as fresh WASM plugins."""
    from epick.config import BUILTIN_POLICY_DIR
    from epick.runtime import PolicyError, WasmPolicy
    from epick.scheduler.policyset import PolicyEntry, PolicySet

    ch = changes or Changes()
    wasm = dict(trace.modules)
    for p in sorted(BUILTIN_POLICY_DIR.glob("*.wasm")):
        data = p.read_bytes()
        wasm.setdefault(hashlib.sha256(data).hexdigest(), data)
    wanted = [(r.name, ch.modules[r.name][0] if r.name in ch.modules else wasm.get(r.sha256),
               {**r.params, **ch.params.get(r.name, {})}, ch.weights.get(r.name, r.weight),
               r.shadow) for r in trace.policies]
    names = {r.name for r in trace.policies}
    for name, (data, _src) in ch.modules.items():
        if name not in names:
            wanted.append((name, data, dict(ch.params.get(name, {})),
                           ch.weights.get(name, 1.0), False))
    for option, keys in (("--weights", ch.weights), ("--params", ch.params)):
        for k in keys:
            if k not in names and k not in ch.modules:
                raise ReplayError(f"{option} names policy {k!r}, which is neither in the "
                                  f"log's policy set ({', '.join(sorted(names))}) nor added "
                                  f"with --policy {k}=FILE.wasm")
    entries = []
    for name, data, params, weight, shadow in wanted:
        if data is None:
            raise ReplayError(f"policy {name!r}: its module is not in the log, nor a "
                              f"built-in; give it with --policy {name}=FILE.wasm")
        try:
            plugin = WasmPolicy(runtime.compile(data, name=name), params, name=name)
        except PolicyError as exc:
            raise ReplayError(f"policy {name!r}: {exc}") from None
        entries.append(PolicyEntry(name, plugin, weight=weight, shadow=shadow))
    return PolicySet(tuple(entries))
