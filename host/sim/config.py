"""The replica's calibration: one frozen Struct, every constant documented with its source.

host/sim/README.md lists the same constants with the reference numbers they come from
(public figures for a 7–8B model on one H100 under vLLM v1). Change a value by
building a new config (``msgspec.structs.replace(DEFAULT_CONFIG, max_loras=4)``) or by
decoding one with :func:`load_config`, which rejects unknown keys and names the bad path.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

__all__ = ["ReplicaConfig", "DEFAULT_CONFIG", "load_config"]

_Pos = Annotated[float, msgspec.Meta(gt=0)]
_NonNeg = Annotated[float, msgspec.Meta(ge=0)]
_PosInt = Annotated[int, msgspec.Meta(gt=0)]
_NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class ReplicaConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One simulated vLLM replica. All times are seconds, all sizes tokens or blocks."""

    model: str = "sim-base"
    """Base model name: requests naming it run without an adapter."""

    # --- timing -----------------------------------------------------------------------
    frontend_overhead_s: _NonNeg = 0.024
    """Fixed latency between a request's arrival and its entry into the engine's waiting
    queue (HTTP, tokenization, input processing). It holds no GPU time. With one base
    decode step on top it gives the 25–40 ms TTFT floor of the calibration ("prefill overhead
    25–40 ms"): 24 ms + 6 ms + prompt/prefill rate."""
    prefill_tokens_per_s: _Pos = 25_000.0
    """Uncached prompt tokens computed per second of step time (reference: 20–35k tok/s
    saturated)."""
    decode_step_base_s: _Pos = 0.006
    """Fixed cost of every engine step (reference: decode step ~6 ms)."""
    per_context_token_s: _NonNeg = 0.04e-6
    """Extra step time per token of context held by the requests in the batch
    (reference: ~0.04 µs per token of context)."""

    # --- continuous batching (vLLM v1 defaults for an OpenAI server on an 80 GB GPU) -------
    max_num_seqs: _PosInt = 256
    """Maximum running batch (vLLM ``--max-num-seqs``)."""
    max_num_batched_tokens: _PosInt = 8192
    """Token budget of one step; prompts longer than the rest of it are prefilled in
    chunks (vLLM ``--max-num-batched-tokens``, chunked prefill on)."""
    max_model_len: _PosInt = 32_768
    """Longest prompt + output a request may have; longer ones are rejected."""

    # --- KV cache ----------------------------------------------------------------------
    block_size: _PosInt = 16
    """Tokens per KV block (vLLM default 16). With 4 bytes per token a block is 64 prompt
    bytes — the same block the prefix policy hashes."""
    num_gpu_blocks: _PosInt = 26_000
    """KV blocks on the device. Llama-3-8B in bf16 needs 2·32 layers·8 KV heads·128 dims·2
    bytes = 128 KiB per token; an 80 GB H100 at 0.9 utilisation leaves ~56 GB after the
    16 GB of weights = ~427k tokens = ~26.7k blocks of 16."""
    enable_prefix_caching: bool = True
    """Automatic prefix caching: full prompt blocks are kept, keyed by a hash chain, and
    reused by later requests with the same leading blocks."""

    # --- LoRA --------------------------------------------------------------------------
    max_loras: _NonNegInt = 2
    """Adapter slots on the GPU (vLLM ``--max-loras``); 0 = LoRA disabled."""
    max_cpu_loras: _NonNegInt = 0
    """Adapters kept in host memory (vLLM ``--max-cpu-loras``); 0 means "same as
    max_loras", vLLM's default. A load of an adapter still in host memory costs
    ``lora_load_host_s``, any other load ``lora_load_disk_s``."""
    lora_load_host_s: _NonNeg = 0.010
    """Copying an adapter from host memory into a GPU slot (reference: a few ms to
    ~20 ms). The whole step waits for it, as in vLLM."""
    lora_load_disk_s: _NonNeg = 0.150
    """Loading an adapter from local disk (reference: 100 ms to seconds)."""
    lora_metrics: Literal["current", "older"] = "current"
    """What ``vllm:lora_requests_info`` means on the page. ``current`` (vLLM 0.1x, seen on
    0.32): every adapter with an admitted in-flight request is written into BOTH
    ``running_lora_adapters`` and ``waiting_lora_adapters``, and a request deferred for
    want of a slot is in neither (it counts as ``num_requests_waiting_by_reason
    {reason="deferred"}``). ``older``: disjoint sets — adapters of running requests,
    adapters of queued ones (the queue split by reason is on the page either way)."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"block_size ({self.block_size})"
            )

    @property
    def cpu_lora_capacity(self) -> int:
        """Adapters host memory holds: ``max_cpu_loras``, or ``max_loras`` when 0."""
        return max(self.max_cpu_loras or self.max_loras, self.max_loras)


DEFAULT_CONFIG = ReplicaConfig()

_decoder = msgspec.json.Decoder(ReplicaConfig)


def load_config(data: bytes | str, *, source: str = "<config>") -> ReplicaConfig:
    """Decode a JSON replica config; errors name ``source`` and the JSON path.

    Raises
    ------
    ValueError
        ``"<source>: Object contains unknown field `x`"``, ``"<source>: Expected `float`
        > 0.0 - at `$.prefill_tokens_per_s`"``, malformed JSON, and the like.
    """
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ValueError(f"{source}: {exc}") from None
