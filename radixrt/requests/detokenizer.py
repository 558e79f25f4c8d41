"""Incremental detokenization with stop-string trimming.

Used by the in-process Engine and by the server's detokenizer process, so
both produce the same text for the same tokens.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into cumulative text.

    `push` returns the text so far. While the request runs it holds back an
    incomplete UTF-8 sequence (a trailing U+FFFD) and any tail that could be
    the start of a stop string, so streamed text never shows characters that
    the final text will not contain. When the request finishes on a stop
    string, the text is cut before it (unless ``no_stop_trim``).
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        no_stop_trim: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = [s for s in stop if s]
        self.no_stop_trim = no_stop_trim
        self.ids: list[int] = []
        self.text = ""

    def _decode(self) -> str:
        return self.tokenizer.decode(
            self.ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def push(self, new_ids: Sequence[int], finish_reason: Optional[dict] = None) -> str:
        self.ids.extend(new_ids)
        full = self._decode()
        if finish_reason is not None:
            self.text = self._trim_final(full, finish_reason)
            return self.text
        stable = full.rstrip("\ufffd")
        held = self._stop_prefix_len(stable)
        candidate = stable[: len(stable) - held]
        if len(candidate) > len(self.text) and candidate.startswith(self.text):
            self.text = candidate
        return self.text

    def _trim_final(self, full: str, finish_reason: dict) -> str:
        matched = finish_reason.get("matched")
        if finish_reason.get("type") != "stop" or not isinstance(matched, str) or self.no_stop_trim:
            return full
        cut = full.find(matched)
        return full[:cut] if cut >= 0 else full

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
