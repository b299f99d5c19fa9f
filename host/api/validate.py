"""The edge of the Pick API: a :class:`PickRequest` checked field by field and turned into
the policies' :class:`abi.Request`, so nothing behind it re-checks. Every front end's
request passes here (through :meth:`epick.api.decide.Decider.decide`); an error is an
:class:`InvalidArgument` naming the field and what was wrong.
"""

from __future__ import annotations

import random

from epick import abi
from epick.api.gen.epick.v1 import picker_pb2

__all__ = ["InvalidArgument", "to_request", "pin_of", "to_completion", "random_seed",
           "estimate_tokens", "SLO_TTFT_HEADERS", "SLO_TPOT_HEADERS", "SESSION_HEADER",
           "MAX_PROMPT_BYTES", "MAX_NAME", "MAX_HEADERS", "MAX_HEADER_BYTES"]

#: Limits on request fields; beyond them a request is INVALID_ARGUMENT.
MAX_PROMPT_BYTES = 4 << 20
MAX_NAME = 256
MAX_HEADERS = 128
MAX_HEADER_BYTES = 16 << 10
#: The session key's header when ``PickRequest.session_id`` is empty, by default
#: (``[server] session_header`` sets another).
SESSION_HEADER = "x-session-id"

# PickRequest.Criticality -> abi.Criticality (UNSPECIFIED means STANDARD).
_CRITICALITY = {
    picker_pb2.CRITICALITY_UNSPECIFIED: abi.Criticality.STANDARD,
    picker_pb2.CRITICAL: abi.Criticality.CRITICAL,
    picker_pb2.STANDARD: abi.Criticality.STANDARD,
    picker_pb2.SHEDDABLE: abi.Criticality.SHEDDABLE,
}
_COMPLETION = {
    picker_pb2.OK: abi.CompletionStatus.OK,
    picker_pb2.ERROR: abi.CompletionStatus.ERROR,
    picker_pb2.CANCELLED: abi.CompletionStatus.CANCELLED,
}


class InvalidArgument(ValueError):
    """A request field is malformed; the message names the field and what was wrong."""


def _check_name(field: str, value: str, *, required: bool = False) -> None:
    if required and not value:
        raise InvalidArgument(f"{field} is required")
    if len(value) > MAX_NAME:
        raise InvalidArgument(f"{field} is {len(value)} characters long; the limit is {MAX_NAME}")
    if "," in value:
        raise InvalidArgument(f"{field} {value!r} contains a comma, which no model server allows")
    if value != value.strip():
        raise InvalidArgument(f"{field} {value!r} has leading or trailing whitespace")
    if not value.isprintable():
        raise InvalidArgument(f"{field} {value!r} contains control characters")


#: Model and adapter names that passed :func:`_check_name` (a name's checks depend on the
#: name alone): requests name a handful, so a pick checks a set instead of five string
#: scans. Bounded: names are the caller's to choose.
_GOOD_NAMES: set[str] = set()
_MAX_GOOD_NAMES = 4096


def _checked(field: str, value: str) -> None:
    """:func:`_check_name` of a non-empty name, remembered when it passes."""
    _check_name(field, value)
    if len(_GOOD_NAMES) < _MAX_GOOD_NAMES:
        _GOOD_NAMES.add(value)


def random_seed() -> int:
    """A fresh u64 seed for a request that brought none (the API's default, so the
    scheduler only ever sees seeded requests)."""
    return random.getrandbits(64)


def to_request(msg: picker_pb2.PickRequest, session_header: str = SESSION_HEADER
               ) -> abi.Request:
    """Validate a PickRequest and turn it into the policies' :class:`abi.Request`.
    ``session_header``: the (lower-case) header naming the session when
    ``PickRequest.session_id`` is empty (``[server] session_header``)."""
    # Each protobuf field access builds a new Python object (a str decoded from UTF-8
    # for the prompt): read every field once.
    model, adapter, prompt = msg.model, msg.adapter, msg.prompt
    request_id, cache_salt, headers = msg.request_id, msg.cache_salt, msg.headers
    if model not in _GOOD_NAMES:
        if not model:
            raise InvalidArgument("PickRequest.model is required")
        _checked("PickRequest.model", model)
    if adapter and adapter not in _GOOD_NAMES:
        _checked("PickRequest.adapter", adapter)
    if len(request_id) > MAX_NAME:
        raise InvalidArgument(
            f"PickRequest.request_id is {len(request_id)} characters long; "
            f"the limit is {MAX_NAME}"
        )
    if cache_salt:
        if len(cache_salt) > MAX_NAME:
            raise InvalidArgument(
                f"PickRequest.cache_salt is {len(cache_salt)} characters long; "
                f"the limit is {MAX_NAME}"
            )
        if "\0" in cache_salt:
            # The prefix hash frames the salt with NUL bytes (policies/ABI.md).
            raise InvalidArgument("PickRequest.cache_salt contains a NUL character")
    # A character is at most 4 UTF-8 bytes: only a long prompt needs encoding to count.
    if len(prompt) * 4 > MAX_PROMPT_BYTES:
        prompt_bytes = len(prompt.encode())
        if prompt_bytes > MAX_PROMPT_BYTES:
            raise InvalidArgument(
                f"PickRequest.prompt is {prompt_bytes} bytes; the limit is {MAX_PROMPT_BYTES}"
            )
    criticality = _CRITICALITY.get(msg.criticality)
    if criticality is None:
        raise InvalidArgument(
            f"PickRequest.criticality {msg.criticality} is not one of CRITICAL (1), "
            "STANDARD (2), SHEDDABLE (3)"
        )
    if headers:
        if len(headers) > MAX_HEADERS:
            raise InvalidArgument(
                f"PickRequest.headers has {len(headers)} entries; the limit is {MAX_HEADERS}"
            )
        headers = dict(headers)
        if sum(len(k) + len(v) for k, v in headers.items()) > MAX_HEADER_BYTES:
            raise InvalidArgument(f"PickRequest.headers exceed {MAX_HEADER_BYTES} bytes in total")
    else:
        headers = {}
    session_id = msg.session_id or headers.get(session_header, "")
    if session_id and len(session_id) > MAX_NAME:
        raise InvalidArgument(f"session id is {len(session_id)} characters long; "
                              f"the limit is {MAX_NAME}")
    return abi.Request(
        request_id=request_id,
        model=model,
        adapter=adapter,
        prompt=prompt,
        criticality=criticality,
        seed=msg.seed if msg.HasField("seed") else random_seed(),
        cache_salt=cache_salt,
        headers=headers,
        # _slo only when there is something to read (a field set, or headers).
        slo_ttft_ms=(_slo(msg, "slo_ttft_ms", headers, SLO_TTFT_HEADERS)
                     if headers or msg.HasField("slo_ttft_ms") else 0),
        slo_tpot_ms=(_slo(msg, "slo_tpot_ms", headers, SLO_TPOT_HEADERS)
                     if headers or msg.HasField("slo_tpot_ms") else 0),
        prompt_tokens=(msg.prompt_tokens if msg.HasField("prompt_tokens")
                       else (len(prompt) + 3) // 4),  # estimate_tokens(prompt), inline
        session_id=session_id,
    )


#: Where a request's SLOs come from when the PickRequest fields are unset: llm-d's
#: headers, then their older names.
SLO_TTFT_HEADERS = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
SLO_TPOT_HEADERS = ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms")
#: Largest SLO accepted (a day): beyond it the value is a mistake, not an objective.
MAX_SLO_MS = 86_400_000


def estimate_tokens(prompt: str) -> int:
    """The prompt's tokens when the gateway did not count them: one per 4 bytes, rounded
    up (the simulator's tokenizer; English under BPE tokenizers is close). Characters
    stand in for bytes: exact for ASCII, and no prompt is encoded just to count it."""
    return (len(prompt) + 3) // 4


def _slo(msg: picker_pb2.PickRequest, field: str, headers: dict[str, str],
         names: tuple[str, ...]) -> int:
    """An SLO in ms from the PickRequest field, else the first of ``names`` present in
    the headers; 0 = none. A header that is not a whole number of ms >= 0 is refused."""
    if msg.HasField(field):
        value = getattr(msg, field)
        if value > MAX_SLO_MS:
            raise InvalidArgument(f"PickRequest.{field} is {value}; the limit is {MAX_SLO_MS}")
        return value
    if not headers:
        return 0
    for name in names:
        raw = headers.get(name)
        if raw is None:
            continue
        text = raw.strip()
        try:
            value = float(text)
        except ValueError:
            raise InvalidArgument(f"header {name}: {raw!r} is not a number of ms") from None
        if not 0 <= value <= MAX_SLO_MS:
            raise InvalidArgument(f"header {name}: {raw!r} is not in [0, {MAX_SLO_MS}] ms")
        return int(round(value))
    return 0


def pin_of(msg: picker_pb2.PickRequest, *, allow_pinning: bool) -> str:
    """The endpoint ``msg`` pins (``""``: none); refused unless pinning is allowed."""
    pin = msg.pin_endpoint
    if not pin:
        return ""
    if not allow_pinning:
        raise InvalidArgument(
            f"PickRequest.pin_endpoint {pin!r} is refused: pinning is off on this server "
            "(set [server] allow_pinning = true to allow it)")
    _check_name("PickRequest.pin_endpoint", pin)
    host, sep, port = pin.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidArgument(f"PickRequest.pin_endpoint {pin!r} is not host:port")
    return pin


def to_completion(msg: picker_pb2.CompletionReport) -> abi.CompletionStatus:
    """Validate a CompletionReport; its status as :class:`abi.CompletionStatus`."""
    if not msg.decision_id and not msg.request_id:
        raise InvalidArgument("CompletionReport needs decision_id or request_id; both are empty")
    status = _COMPLETION.get(msg.status)
    if status is None:
        raise InvalidArgument(
            f"CompletionReport.status {msg.status} is not one of OK (0), ERROR (1), "
            "CANCELLED (2)"
        )
    return status
