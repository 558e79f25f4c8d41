"""Incremental detokenization with stop-string trimming.

Used by the in-process Engine (in the caller's thread, never the scheduler's)
and by the server's detokenizer process, so both produce the same text for
the same tokens.

Each new token costs one step of the `tokenizers` library's own streaming
decoder (`tokenizers.decoders.DecodeStream`, in Rust), not a decode
of the whole output: the cost of a request's text is linear in its length.
The final text, once, is the tokenizer's plain ``decode`` of all output ids,
so it always equals what ``tokenizer.decode(output_ids)`` gives, except after a
prompt that ends inside a character (a byte-level token of a character's first
bytes): the output's first bytes complete that character, so its text is the
decode of the prompt's tail and the output, less the tail's complete text (the
character whole, where decoding the output alone gave replacement characters).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

# how many of the prompt's last ids a detokenizer is given (`IncrementalDetokenizer`'s ``prompt_tail``):
# a character's UTF-8 bytes (4 at most) are at most 4 byte-level tokens
PROMPT_TAIL_TOKENS = 4


def _finish_fields(finish_reason: Any) -> tuple[Optional[str], Any]:
    """(type, matched) of a finish reason given as a dict or an object."""
    if isinstance(finish_reason, dict):
        return finish_reason.get("type"), finish_reason.get("matched")
    return getattr(finish_reason, "type", None), getattr(finish_reason, "matched", None)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into cumulative text.

    `push` returns the text so far. While the request runs it holds back an
    incomplete UTF-8 sequence and any tail that could be the start of a stop
    string, so streamed text never shows characters that the final text will
    not contain. When the request finishes on a stop string, the text is cut
    before it, and on a stop token (EOS included) that token's text is left out
    (both unless ``no_stop_trim``; SGLang's ``trim_matched_stop``: with
    ``skip_special_tokens`` false an answer does not end in ``<|im_end|>``).

    A request that finishes on a stop regex reports the pattern as ``matched``
    and, as in SGLang, its text is cut where the pattern's own text first
    occurs (usually nowhere: the matched text stays, see
    `radixrt.sampling.stop_regex`); so the patterns' texts are held back
    while streaming like stop strings.
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        no_stop_trim: bool = False,
        stop_regex: Sequence[str] = (),
        prompt_tail: Sequence[int] = (),
    ) -> None:
        """``prompt_tail``: the prompt's last few ids (`PROMPT_TAIL_TOKENS`); they are the decoding
        context of the output only when the prompt ends inside a character."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = [s for s in stop if s]
        self._held = self.stop + [p for p in stop_regex if p and p not in self.stop]  # tails held back
        self.no_stop_trim = no_stop_trim
        self.ids: list[int] = []
        self.text = ""
        # the fast tokenizer's Rust object; a slow (Python) tokenizer has none
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: Any = None
        self._decoded = ""  # everything the stream has produced (before stop-string holding)
        # a prompt ending inside a character: its tail decodes before the output, and the text of the
        # tail's complete characters (``_context_chars`` of them) is cut from every decode
        self._context: list[int] = []
        self._context_chars = self._held_context = 0
        tail_text = self._decode(list(prompt_tail)) if prompt_tail else ""
        if tail_text.endswith("\ufffd"):
            self._context, self._context_chars = list(prompt_tail), len(tail_text.rstrip("\ufffd"))
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            primed = "".join(self._stream.step(self._backend, tid) or "" for tid in self._context)
            # the context's text the stream still holds (the partial character's token may start with
            # a space): it comes out before the output's, and is not the output's
            self._held_context = self._context_chars - len(primed)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def _full_decode(self, upto: Optional[int] = None) -> str:
        """The text of the output ids (up to ``upto``), after the prompt's partial character."""
        if not self._context:
            return self._decode(self.ids[:upto])
        return self._decode(self._context + self.ids[:upto])[self._context_chars :]

    def _stream_decode(self, new_ids: Sequence[int]) -> str:
        if self._stream is None:  # no streaming decoder: decode all, drop a dangling partial character
            return self._full_decode().rstrip("\ufffd")
        for tid in new_ids:
            piece = self._stream.step(self._backend, tid)
            if piece:
                self._decoded += piece
        return self._decoded[self._held_context :]

    def push(self, new_ids: Sequence[int], finish_reason: Any = None) -> str:
        self.ids.extend(new_ids)
        if finish_reason is not None:
            self.text = self._final_text(finish_reason)
            return self.text
        stable = self._stream_decode(new_ids)
        held = self._stop_prefix_len(stable)
        candidate = stable[: len(stable) - held]
        if len(candidate) > len(self.text) and candidate.startswith(self.text):
            self.text = candidate
        return self.text

    def _final_text(self, finish_reason: Any) -> str:
        kind, matched = _finish_fields(finish_reason)
        if kind != "stop" or self.no_stop_trim or not isinstance(matched, (str, int)) or isinstance(matched, bool):
            return self._full_decode()
        if isinstance(matched, int):
            return self._full_decode(-1) if self.ids and self.ids[-1] == matched else self._full_decode()
        full = self._full_decode()
        # where the stop that ended it begins: the first occurrence the last token completed (one
        # before min_new_tokens stays text), so the search starts where the last token's text does
        before = self._full_decode(-1)
        cut = full.find(matched, max(0, len(before.rstrip("\ufffd")) - len(matched) + 1))
        if cut < 0:
            cut = full.find(matched)
        return full[:cut] if cut >= 0 else full

    def _stop_prefix_len(self, text: str) -> int:
        return stop_prefix_len(text, self._held)


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``stops``.

    Per stop string, only the tail's positions holding the stop's first character are
    tried, longest first, each by one C-level comparison: about one try per stop on
    text that does not end like one, and at most ``len(stop)`` tries of ``len(stop)``
    characters on the most repetitive (the sampling parameters bound both lengths)."""
    best = 0
    for s in stops:
        tail = text[len(text) - min(len(s) - 1, len(text)) :]
        i = tail.find(s[0]) if tail else -1
        while i != -1 and len(tail) - i > best:
            if s.startswith(tail[i:]):
                best = len(tail) - i
                break
            i = tail.find(s[0], i + 1)
    return best
