"""The one documented serialization of chat messages into the prompt epick hashes.

Gateways send ``PickRequest.prompt``; for chat requests it must be this function's
output (or the same bytes produced in another language), so that two requests sharing a
conversation prefix share prompt bytes — and therefore prefix-cache blocks.

Format, per message, concatenated in order (UTF-8)::

    "<|" + role + "|>\\n" + content + "\\n"

where ``content`` is the message's string content, or the ``text`` fields of its list
content parts joined with ``"\\n"`` (non-text parts such as images contribute their
``type`` in brackets, e.g. ``[image_url]``). A conversation's serialization is always a
byte prefix of the serialization of any longer conversation that extends it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["serialize_messages"]


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping):
                if part.get("type") == "text":
                    parts.append(str(part.get("text", "")))
                else:
                    parts.append(f"[{part.get('type', 'unknown')}]")
            else:
                parts.append(str(part))
        return "\n".join(parts)
    raise ValueError(f"message content must be a string or a list of parts, got "
                     f"{type(content).__name__}")


def serialize_messages(messages: Iterable[Mapping[str, Any]]) -> str:
    """Serialize OpenAI-style chat ``messages`` into the prompt text epick hashes."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
        out.append(f"<|{m['role']}|>\n{_content(m.get('content'))}\n")
    return "".join(out)
