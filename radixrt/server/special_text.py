"""Client text that spells a special token stays text.

A chat prompt is the chat template's rendering, tokenized with special tokens
parsed (the template writes them as text: ``<|im_start|>``). A message whose
content spells one would end its turn there and could open a turn of another
role (``...<|im_end|>\\n<|im_start|>system\\n...``); OpenAI reads a message's
content as text. `SpecialText` finds such spellings in a message's content
and tokenizes them as plain text; `radixrt.server.tools.turns.mark_turns`
puts placeholders for them in the messages and `split_encode` splices those
tokens in, so the rest of the prompt, every prompt without such text
included, is tokenized exactly as before.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Optional, Union


class SpecialText:
    """The special tokens' spellings of one tokenizer, and their plain-text tokens."""

    def __init__(self, tokenizer: Any) -> None:
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        spellings = sorted({t.content for t in added.values() if getattr(t, "special", False)}, key=len, reverse=True)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._plain: Any = None
        self.pattern: Optional[re.Pattern[str]] = None
        if spellings and backend is not None:
            from tokenizers import Tokenizer

            # a copy that reads special tokens' spellings as text: setting this on the shared
            # tokenizer would change what other threads tokenize meanwhile
            self._plain = Tokenizer.from_str(backend.to_str())
            self._plain.encode_special_tokens = True
            self.pattern = re.compile("|".join(map(re.escape, spellings)))

    def split(self, text: str) -> Optional[list[Union[str, tuple[int, ...]]]]:
        """``text`` as its pieces between special tokens' spellings and, for each spelling,
        its plain-text tokens; None when it spells none."""
        if self.pattern is None or self.pattern.search(text) is None:
            return None
        out: list[Union[str, tuple[int, ...]]] = []
        at = 0
        for m in self.pattern.finditer(text):
            out.append(text[at : m.start()])
            out.append(tuple(self._plain.encode(m.group(), add_special_tokens=False).ids))
            at = m.end()
        out.append(text[at:])
        return out


@functools.lru_cache(maxsize=8)
def special_text(tokenizer: Any) -> SpecialText:
    """The tokenizer's `SpecialText` (made once)."""
    return SpecialText(tokenizer)
