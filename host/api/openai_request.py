"""An OpenAI request turned into a :class:`PickRequest`, and a refused pick into an
OpenAI error — the one translation every front end that speaks OpenAI uses (the ext_proc
adapter, ``epick.api.ext_proc``; the HTTP front end; the reference gateway,
``epick.gateway``), so a request is picked for, and refused, the same way whichever way
it came in. Its settings are the config's ``[openai]`` (:class:`epick.config.OpenAIConfig`).

:func:`translate_with` (or :func:`translate`, the settings spelled out) takes the
request's headers (lower-case names), its path and its body, and returns an
:class:`OpenAIRequest` or raises :class:`InvalidArgument` naming what is wrong (a 400).
:func:`refusal` says a refused :class:`~epick.api.decide.Verdict` as status, JSON body
and upstream's dropped-reason header. The rules:

- ``model`` equal to the base model is a base-model request; any other value names a
  LoRA adapter of that base model (vLLM's naming). A model rewrite (the header
  ``x-llm-d-model-name-rewrite``, else the ``model_rewrites`` table) replaces the body's
  ``model`` before that: the backend gets, and epick picks for, the rewritten name;
- ``/chat/completions`` bodies give their prompt through
  :func:`epick.chat.serialize_messages`; others use ``prompt`` (a string or a list of
  strings, joined);
- a body-less request (``GET /v1/models``) is a base-model request with an empty prompt;
- criticality: ``x-criticality`` (critical | standard | sheddable); without it the
  objective header (``x-llm-d-inference-objective``, or the older
  ``x-gateway-inference-objective``) looked up in the ``objectives`` table; an objective
  not in the table, or none, is standard;
- ``x-request-id`` is the request id, a body ``cache_salt`` the salt, and
  ``x-epick-pin-endpoint`` asks for one endpoint (``PickRequest.pin_endpoint``).

Field limits and name rules are the Pick API's own (:func:`epick.api.validate.to_request`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from epick.api.decide import REFUSALS
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.validate import InvalidArgument
from epick.chat import serialize_messages
from epick.config import ConfigError, OpenAIConfig, load

__all__ = [
    "OpenAIRequest",
    "OpenAIError",
    "translate",
    "translate_with",
    "load_settings",
    "OpenAIConfig",
    "ConfigError",
    "refusal",
    "InvalidArgument",
    "OWN_HEADERS",
    "OBJECTIVE_HEADERS",
    "REWRITE_HEADER",
    "PIN_HEADER",
]

CRITICALITY = {"critical": pb.CRITICAL, "standard": pb.STANDARD, "sheddable": pb.SHEDDABLE}
#: The objective header upstream gateways send, newest name first.
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
REWRITE_HEADER = "x-llm-d-model-name-rewrite"
PIN_HEADER = "x-epick-pin-endpoint"
#: Upstream's header on a refusal that says why the request was dropped.
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
#: Headers the gateways set or consume themselves; a client's copy never reaches policies.
OWN_HEADERS = frozenset({"x-gateway-destination-endpoint", "x-epick-decision-id", PIN_HEADER})


@dataclass(slots=True)
class OpenAIRequest:
    pick: pb.PickRequest
    """What to ask the scheduler (not yet validated: :func:`epick.api.validate.to_request`)."""
    body: bytes | None
    """The body to forward: the original bytes, or the rewritten ones (see ``rewritten``)."""
    rewritten: bool = False
    """The model was rewritten, so ``body`` differs from what the client sent."""
    stream: bool = False
    """The body asked for ``"stream": true`` (an SSE answer)."""


def _prompt(path: str, body: dict) -> str:
    if path.split("?", 1)[0].endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise InvalidArgument("body.messages must be a list")
        try:
            return serialize_messages(messages)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"body.messages: {exc}") from None
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if not all(isinstance(p, str) for p in prompt):
            raise InvalidArgument("body.prompt must be a string or a list of strings")
        return "".join(prompt)
    if not isinstance(prompt, str):
        raise InvalidArgument("body.prompt must be a string or a list of strings")
    return prompt


def _criticality(headers: Mapping[str, str], objectives: Mapping[str, str]) -> int:
    crit = headers.get("x-criticality")
    if crit is not None:
        crit = crit.strip().lower()
        if crit not in CRITICALITY:
            raise InvalidArgument(
                f"x-criticality {crit!r} is not critical, standard or sheddable")
        return CRITICALITY[crit]
    for name in OBJECTIVE_HEADERS:
        objective = headers.get(name)
        if objective is not None:
            return CRITICALITY[objectives.get(objective.strip(), "standard")]
    return pb.STANDARD


def translate(headers: Mapping[str, str], path: str, body: bytes | None, *, base_model: str,
              objectives: Mapping[str, str] = {}, rewrites: Mapping[str, str] = {}
              ) -> OpenAIRequest:
    """Build the PickRequest for one OpenAI request.

    ``headers`` have lower-case names (pseudo-headers such as ``:path`` are skipped);
    ``body`` is the whole body, or ``None``/empty when the request has none.
    """
    model, prompt, salt, stream = base_model, "", "", False
    out_body, rewritten = body, False
    if body:
        try:
            doc = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidArgument(f"the body is not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise InvalidArgument("the body must be a JSON object")
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidArgument("body.model must be a non-empty string")
        target = headers.get(REWRITE_HEADER, "").strip() or rewrites.get(model, model)
        if target != model:
            doc["model"] = model = target
            out_body = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
            rewritten = True
        prompt = _prompt(path, doc)
        salt = doc.get("cache_salt", "")
        if not isinstance(salt, str):
            raise InvalidArgument("body.cache_salt must be a string")
        stream = doc.get("stream") is True
    pick = pb.PickRequest(
        request_id=headers.get("x-request-id", ""),
        model=base_model,
        adapter="" if model == base_model else model,
        prompt=prompt,
        criticality=_criticality(headers, objectives),
        cache_salt=salt,
        headers={k: v for k, v in headers.items()
                 if not k.startswith(":") and k not in OWN_HEADERS},
        pin_endpoint=headers.get(PIN_HEADER, "").strip(),
    )
    return OpenAIRequest(pick=pick, body=out_body, rewritten=rewritten, stream=stream)


def translate_with(settings: OpenAIConfig, headers: Mapping[str, str], path: str,
                   body: bytes | None) -> OpenAIRequest:
    """:func:`translate` with the config's ``[openai]`` settings."""
    return translate(headers, path, body, base_model=settings.base_model,
                     objectives=settings.objectives, rewrites=settings.model_rewrites)


def load_settings(path: str) -> OpenAIConfig:
    """The OpenAI settings of the epick config file at ``path`` (``[openai]``, with
    ``[ext_proc]``'s older keys), for a front end outside the service (the reference
    gateway). Raises :class:`epick.config.ConfigError` naming the file."""
    return load(path).openai


@dataclass(slots=True, frozen=True)
class OpenAIError:
    """An OpenAI-style error answer: ``{"error": {"message", "type", "code"}}``."""

    status: int
    kind: str
    """The error's ``type`` (``invalid_request_error``, ``rate_limit_exceeded``, ...)."""
    message: str
    reason: str = ""
    """Upstream's ``x-llm-d-request-dropped-reason`` (``""``: not sent)."""

    def body(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.kind,
                                     "code": self.status}}).encode()

    def headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if self.reason:
            headers[DROPPED_REASON_HEADER] = self.reason
        return headers


def refusal(outcome: str, message: str) -> OpenAIError:
    """How a refused pick (a verdict's ``outcome`` and ``message``) is told to an OpenAI
    client: the status, type and dropped reason of :data:`epick.api.decide.REFUSALS`."""
    r = REFUSALS[outcome]
    prefix = "malformed request: " if outcome == "invalid" else "epick: "
    return OpenAIError(r.http, r.kind, prefix + message, r.reason)
