"""Single tokens as OpenAI's logprobs show them: each token's raw bytes, and its text.

A byte-level BPE token (GPT-2's, Llama 3's, SmolLM2's) or a byte-fallback
token (``<0xF0>``) can hold part of a character: an emoji is often three
tokens. Decoding such a token alone gives U+FFFD, whose bytes are not the
token's, so its ``bytes`` are read from the vocabulary instead: the
byte-level alphabet mapped back to bytes, or the fallback token's hex. Joining
the ``bytes`` of a choice's tokens gives its text's UTF-8.

The ``token`` text of a token whose bytes are not whole UTF-8 is written as
``bytes:\\xf0\\x9f`` (OpenAI's form for such tokens), so two different
partial tokens never share a text (the legacy completions' ``top_logprobs``
are keyed by it)."""

from __future__ import annotations

import functools
import re
from typing import Any

from radixrt.requests.no_tokenizer import has_text

_FALLBACK_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (a printable character per byte), back to the bytes."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


class TokenTexts:
    """Per-request cache of single-token texts and bytes (for logprobs)."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        # vLLM's return_tokens_as_token_ids: every text is "token_id:<id>" (the only name a token
        # has without a tokenizer, --skip-tokenizer-init)
        self.as_ids = as_ids or not has_text(tokenizer)
        self.cache: dict[int, str] = {}
        self.raw: dict[int, bytes] = {}

    def decoded(self, tid: int) -> str:
        """The token decoded alone (U+FFFD for a partial character)."""
        s = self.cache.get(tid)
        if s is None:
            s = self.cache[tid] = self.tokenizer.decode([tid])
        return s

    def token_bytes(self, tid: int) -> bytes:
        """The token's own bytes (not those of U+FFFD where it holds part of a character)."""
        b = self.raw.get(tid)
        if b is None:
            b = self.raw[tid] = self._read_bytes(tid)
        return b

    def _read_bytes(self, tid: int) -> bytes:
        text = self.decoded(tid)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(tid)
        if isinstance(piece, str):
            fallback = _FALLBACK_BYTE.fullmatch(piece)
            if fallback:
                return bytes([int(fallback.group(1), 16)])
            alphabet = _byte_level_alphabet()
            if piece and all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        return text.encode("utf-8")  # a token that decodes to U+FFFD itself

    def __call__(self, tid: int) -> str:
        """The token's text: decoded, or ``bytes:\\x..`` where its bytes are not whole UTF-8
        (``token_id:<id>`` for every token with ``as_ids``)."""
        if self.as_ids:
            return f"token_id:{tid}"
        raw = self.token_bytes(tid)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
