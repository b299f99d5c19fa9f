"""Turn a Pick's prompt into the token ids the engine will cache.

A Pick carries text: a completion prompt, or for chat requests epick's documented
serialization of the messages (:func:`epick.chat.serialize_messages`). A prompt that
parses entirely as that serialization is treated as chat: the messages go back through
the model's own chat template (``add_generation_prompt``, as vLLM's chat endpoint does)
and are tokenized WITHOUT special tokens (vLLM's chat default ``add_special_tokens=False``:
the template writes BOS itself). Anything else is a completion prompt, tokenized WITH
special tokens (the tokenizer's post-processor adds BOS, as vLLM's completions do).

Two tokenizers:

- :class:`HfTokenizer` — the model's ``tokenizer.json`` (HF ``tokenizers``) plus
  ``tokenizer_config.json`` (special tokens, ``chat_template``, or ``chat_template.jinja``
  beside it), the template rendered like ``transformers`` does (sandboxed Jinja,
  ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, ``tojson``).
- :class:`BytesTokenizer` — the simulator's contract: token *i* is
  ``int.from_bytes(utf8[4i:4i+4], "little")``, the last partial chunk zero-padded; no BOS;
  chat prompts are taken as their serialized text (the simulator has no template).
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

import numpy as np

__all__ = [
    "BytesTokenizer",
    "HfTokenizer",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
    "parse_serialized_messages",
]


class TokenizerError(ValueError):
    """Tokenizer files are missing or invalid, or a template failed; says which and why."""


class Tokenizer(Protocol):
    """What the host needs: a Pick prompt → the token ids the engine caches."""

    name: str

    def encode_prompt(self, prompt: str) -> list[int]:
        """A completion prompt, with the special tokens the engine adds (BOS)."""
        ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Chat messages through the chat template, as the engine's chat endpoint does."""
        ...

    def encode_pick(self, prompt: str) -> list[int]:
        """A Pick prompt: chat if it parses as serialized messages, else a completion."""
        ...


_HEADER = re.compile(r"<\|([^|\n<>]+)\|>\n")


def parse_serialized_messages(prompt: str) -> list[dict[str, str]] | None:
    """Invert :func:`epick.chat.serialize_messages`; None unless ``prompt`` is one whole.

    A header ``<|role|>\\n`` starts a message only at the start or right after the previous
    message's closing newline; content containing such a header line is split there (the
    serialization is ambiguous in that case, and the first reading is as good as any).
    """
    if not prompt.startswith("<|") or not prompt.endswith("\n"):
        return None
    heads = [m for m in _HEADER.finditer(prompt) if m.start() == 0 or prompt[m.start() - 1] == "\n"]
    if not heads or heads[0].start() != 0:
        return None
    out = []
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(prompt)
        body = prompt[m.end() : end]
        if not body.endswith("\n"):
            return None
        out.append({"role": m.group(1), "content": body[:-1]})
    return out


class _PickMixin:
    def encode_pick(self, prompt: str) -> list[int]:
        messages = parse_serialized_messages(prompt)
        if messages is None:
            return self.encode_prompt(prompt)  # type: ignore[attr-defined]
        return self.encode_chat(messages)  # type: ignore[attr-defined]


class BytesTokenizer(_PickMixin):
    """The simulator's tokenizer (see the module doc); chat = the serialized text."""

    name = "bytes"

    def encode_prompt(self, prompt: str) -> list[int]:
        data = prompt.encode()
        pad = -len(data) % 4
        if pad:
            data += b"\0" * pad
        return np.frombuffer(data, "<u4").tolist()  # 10x a Python loop (epick bench kv)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        from epick.chat import serialize_messages

        return self.encode_prompt(serialize_messages(messages))

    def encode_pick(self, prompt: str) -> list[int]:
        return self.encode_prompt(prompt)


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return v["content"]
    return None


class HfTokenizer(_PickMixin):
    """A model's own tokenizer files (see the module doc)."""

    def __init__(self, directory: str | pathlib.Path) -> None:
        from tokenizers import Tokenizer as _Tok

        d = pathlib.Path(directory)
        self.name = str(d)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"{tj}: no such file (a model's HF tokenizer.json)")
        try:
            self._tok = _Tok.from_file(str(tj))
        except Exception as exc:  # tokenizers raises a bare Exception
            raise TokenizerError(f"{tj}: not a tokenizers file: {exc}") from None
        cfg_path = d / "tokenizer_config.json"
        cfg: dict[str, Any] = {}
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text())
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{cfg_path}: {exc}") from None
            if not isinstance(cfg, dict):
                raise TokenizerError(f"{cfg_path}: must be a JSON object")
        self.special = {k: t for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                        if (t := _token_text(cfg.get(k))) is not None}
        self._add_bos = bool(cfg.get("add_bos_token", False))
        self._bos_id = self._tok.token_to_id(self.special["bos_token"]) \
            if "bos_token" in self.special else None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = d / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self._template = None
        if template is not None:
            if not isinstance(template, str):
                raise TokenizerError(f"{cfg_path}: chat_template must be a string")
            self._template = _compile(template, self.name)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def _encode(self, text: str, special: bool) -> list[int]:
        # encode_batch_fast skips the offsets: ~30% less per 1 k tokens (epick bench kv).
        return self._tok.encode_batch_fast([text], add_special_tokens=special)[0].ids

    def encode_prompt(self, prompt: str) -> list[int]:
        ids = self._encode(prompt, True)
        # A config asking for BOS the post-processor does not add (older Llama files).
        if self._add_bos and self._bos_id is not None and (not ids or ids[0] != self._bos_id):
            ids = [self._bos_id, *ids]
        return ids

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        if self._template is None:
            raise TokenizerError(f"{self.name}: the tokenizer has no chat template")
        try:
            text = self._template.render(messages=list(messages), add_generation_prompt=True,
                                         **self.special)
        except Exception as exc:
            raise TokenizerError(f"{self.name}: chat template failed: {exc}") from None
        return self._encode(text, False)


def _compile(template: str, where: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"{where}: chat template does not compile: {exc}") from None


def load_tokenizer(spec: str, base: pathlib.Path | None = None) -> Tokenizer:
    """``"bytes"`` or a tokenizer directory (relative to ``base``, e.g. the config's dir)."""
    if spec == "bytes":
        return BytesTokenizer()
    p = pathlib.Path(spec)
    if not p.is_absolute() and base is not None:
        p = base / p
    if not p.is_dir():
        raise TokenizerError(f"{p}: not a directory (want a model dir with tokenizer.json, "
                             "or \"bytes\")")
    return HfTokenizer(p)
