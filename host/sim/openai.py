"""The OpenAI-compatible wire format the simulated servers speak (vLLM's subset).

Requests are decoded once, here, with typed decoders; a bad body becomes
:class:`BadRequest` whose message is msgspec's (``Expected `int`, got `str` - at
`$.max_tokens```). Responses and stream chunks are Structs encoded with msgspec.

Chat prompts: the sim has no real chat template. Messages become prompt text as
``"<|{role}|>\\n{content}\\n"`` per message plus ``"<|assistant|>\\n"`` — deterministic,
so the same conversation prefix always gives the same leading KV blocks. A ``content``
that is a list of parts keeps its ``text`` parts, joined with no separator.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "BadRequest", "CompletionRequest", "ChatRequest", "decode_completion", "decode_chat",
    "chat_prompt", "Usage", "CompletionChoice", "Completion", "ChatDelta", "ChatChunkChoice",
    "ChatChunk", "ChatMessage", "ChatChoice", "ChatCompletion", "ErrorBody", "ErrorInfo",
    "DEFAULT_MAX_TOKENS",
]

DEFAULT_MAX_TOKENS = 16
"""``max_tokens`` when a request leaves it out (OpenAI's completions default; the sim
uses it for chat too, where vLLM would fill the remaining context)."""


class BadRequest(ValueError):
    """The body is not a valid request; the message says where."""


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False


class CompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    prompt: str | list[str]
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str = ""


class ContentPart(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    text: str = ""


class Message(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str = ""


_completion = msgspec.json.Decoder(CompletionRequest)
_chat = msgspec.json.Decoder(ChatRequest)


def _decode(decoder: msgspec.json.Decoder, body: bytes):  # type: ignore[no-untyped-def]
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from None


def decode_completion(body: bytes) -> tuple[CompletionRequest, str, int]:
    """Decode a ``/v1/completions`` body into (request, prompt text, max_tokens)."""
    req: CompletionRequest = _decode(_completion, body)
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise BadRequest(f"prompt: the sim serves one prompt per request, got {len(prompt)}")
        prompt = prompt[0]
    return req, prompt, _max_tokens(req.max_tokens, "max_tokens")


def decode_chat(body: bytes) -> tuple[ChatRequest, str, int]:
    """Decode a ``/v1/chat/completions`` body into (request, prompt text, max_tokens)."""
    req: ChatRequest = _decode(_chat, body)
    if not req.messages:
        raise BadRequest("messages: at least one message is required")
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return req, chat_prompt(req.messages), _max_tokens(limit, "max_tokens")


def _max_tokens(value: int | None, name: str) -> int:
    if value is None:
        return DEFAULT_MAX_TOKENS
    if value < 1:
        raise BadRequest(f"{name} must be at least 1, got {value}")
    return value


def chat_prompt(messages: list[Message]) -> str:
    """The sim's chat template (see the module docstring)."""
    parts = []
    for m in messages:
        content = m.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            text = "".join(p.text for p in content if p.type == "text")
        parts.append(f"<|{m.role}|>\n{text}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


# --- responses -------------------------------------------------------------------------


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A ``text_completion`` (whole response, or one stream chunk)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatChunk(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str = "assistant"
    content: str


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    message: ChatMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ErrorInfo(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    error: ErrorInfo
