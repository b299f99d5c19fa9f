"""An OpenAI request, as Envoy hands it to ext_proc, turned into the policies' Request.

One function, :func:`to_request`: the headers Envoy sent and the buffered body in, a
validated :class:`epick.abi.Request` out, or :class:`InvalidArgument` naming what is wrong
(the adapter answers that with a 400). The rules match the reference gateway
(``gateway/proxy.py``):

- ``model`` equal to the base model is a base-model request; any other value names a
  LoRA adapter of that base model (vLLM's naming);
- ``/chat/completions`` bodies give their prompt through
  :func:`epick.chat.serialize_messages`; others use ``prompt`` (a string or a list of
  strings, joined);
- a body-less request (``GET /v1/models``) is a base-model request with an empty prompt;
- ``x-criticality`` (critical | standard | sheddable, default standard) sets criticality,
  ``x-request-id`` (Envoy sets one) the request id, a body ``cache_salt`` the salt.

Field limits and name rules are the Pick API's own (:func:`epick.api.picker.to_request`).
"""

from __future__ import annotations

import json

from epick import abi
from epick.api.gen.epick.v1 import picker_pb2 as pb
from epick.api.picker import InvalidArgument
from epick.api.picker import to_request as _validate
from epick.chat import serialize_messages

__all__ = ["to_request", "InvalidArgument", "OWN_HEADERS"]

_CRITICALITY = {"critical": pb.CRITICAL, "standard": pb.STANDARD, "sheddable": pb.SHEDDABLE}

#: Headers the adapter itself sets; a client's copy is never passed to policies.
OWN_HEADERS = frozenset({"x-gateway-destination-endpoint", "x-epick-decision-id"})


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


def to_request(headers: dict[str, str], body: bytes | None, *, base_model: str) -> abi.Request:
    """Validate one request and build what the scheduler takes.

    ``headers`` are lower-case names (pseudo-headers like ``:path`` included); ``body``
    is the whole buffered body, or ``None`` when the request has none.
    """
    path = headers.get(":path", "/")
    model, prompt, salt = base_model, "", ""
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
        prompt = _prompt(path, doc)
        salt = doc.get("cache_salt", "")
        if not isinstance(salt, str):
            raise InvalidArgument("body.cache_salt must be a string")
    crit = headers.get("x-criticality", "standard").strip().lower()
    if crit not in _CRITICALITY:
        raise InvalidArgument(f"x-criticality {crit!r} is not critical, standard or sheddable")
    return _validate(pb.PickRequest(
        request_id=headers.get("x-request-id", ""),
        model=base_model,
        adapter="" if model == base_model else model,
        prompt=prompt,
        criticality=_CRITICALITY[crit],
        cache_salt=salt,
        headers={k: v for k, v in headers.items()
                 if not k.startswith(":") and k not in OWN_HEADERS},
    ))
