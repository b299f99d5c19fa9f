"""An OpenAI request, as Envoy hands it to ext_proc, turned into the policies' Request.

Kept for callers of :func:`to_request`; the translation itself is
:func:`epick.api.openai_request.translate`, shared with the reference gateway.
"""

from __future__ import annotations

from epick import abi
from epick.api.openai_request import OWN_HEADERS, InvalidArgument, translate
from epick.api.picker import to_request as _validate

__all__ = ["to_request", "InvalidArgument", "OWN_HEADERS"]


def to_request(headers: dict[str, str], body: bytes | None, *, base_model: str) -> abi.Request:
    """Validate one request and build what the scheduler takes.

    ``headers`` are lower-case names (pseudo-headers like ``:path`` included); ``body``
    is the whole buffered body, or ``None`` when the request has none.
    """
    parsed = translate(headers, headers.get(":path", "/"), body, base_model=base_model)
    return _validate(parsed.pick)
