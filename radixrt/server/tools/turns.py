"""The model's own tokens for assistant turns it generated (exact prefixes
across the steps of an agent loop).

A generated turn is sent back by the client as text (``content`` and
``tool_calls``), and re-tokenizing that text need not give the tokens the
model produced: where a grammar forced text the model may have picked
``' {'`` then ``'"'`` where the tokenizer writes ``' {"'``. The radix cache
holds the produced tokens, so a re-tokenized turn stops the prefix match
inside it. ``TurnTokens`` remembers, per generated text, the tokens that
produced it (an LRU); the prompt of a later step uses them for an assistant
turn whose rendered text is exactly that text, so the whole earlier
conversation is a cached prefix.

Used for the generic tool format only, where radixrt writes the turn's text
itself (``parser.render_calls``) and the chat template inserts it verbatim;
``split_encode`` checks that (each placeholder appears exactly once) and
otherwise the prompt is tokenized as usual. The same placeholders carry the
plain-text tokens of special tokens spelled in a message's content
(radixrt/server/special_text.py), on every chat prompt.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Optional

from radixrt.server.special_text import SpecialText

_MARK = "\ue000radixrt-turn-{}\ue001"


class TurnTokens:
    """text -> token ids of generated assistant turns, least recently used out."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._d: "OrderedDict[str, tuple[int, ...]]" = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, text: str, ids: list[int], decode: Callable[[list[int]], str]) -> None:
        """Keep ``ids`` for ``text`` when they decode to it (a trailing stop token dropped). A
        turn that ends in whitespace (the newline a model may write after its last tool call) is
        kept without it too: the client's copy of the turn renders back without it."""
        self._keep(text, ids, decode)
        stripped = text.rstrip()
        if stripped != text:
            self._keep(stripped, ids[:-1], decode)

    def _keep(self, text: str, ids: list[int], decode: Callable[[list[int]], str]) -> None:
        if not text:
            return
        for cut in (ids, ids[:-1]):
            if cut and decode(list(cut)) == text:
                with self._lock:
                    self._d[text] = tuple(cut)
                    self._d.move_to_end(text)
                    while len(self._d) > self.capacity:
                        self._d.popitem(last=False)
                return

    def get(self, text: str) -> Optional[tuple[int, ...]]:
        with self._lock:
            ids = self._d.get(text)
            if ids is not None:
                self._d.move_to_end(text)
            return ids


TURNS = TurnTokens()  # one per server process


def mark_turns(
    messages: list[dict],
    turns: Optional[TurnTokens],
    special: Optional[SpecialText] = None,
    last_turn: bool = True,
) -> tuple[list[dict], list[tuple[int, ...]]]:
    """``messages`` with placeholders, and the tokens each stands for, in prompt order:
    a remembered assistant turn's whole content (``turns``; the last message's only when
    ``last_turn``), and in other contents each special token's spelling (``special``:
    its plain-text tokens, radixrt/server/special_text.py)."""
    out: list[dict] = []
    spliced: list[tuple[int, ...]] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, str) or not content:
            out.append(m)
            continue
        pieces = special.split(content) if special is not None else None
        # a turn that spells a special token is never reused: its generated ids may hold the real
        # token (the model wrote it), and whoever sends the same text would get it read as one
        may_reuse = turns is not None and m.get("role") == "assistant" and (last_turn or i < len(messages) - 1)
        ids = turns.get(content) if may_reuse and pieces is None else None
        if ids is not None:
            out.append({**m, "content": _MARK.format(len(spliced))})
            spliced.append(ids)
            continue
        if pieces is None:
            out.append(m)
            continue
        text = []
        for piece in pieces:
            if isinstance(piece, str):
                text.append(piece)
            else:
                text.append(_MARK.format(len(spliced)))
                spliced.append(piece)
        out.append({**m, "content": "".join(text)})
    return out, spliced


def split_encode(
    prompt: str,
    spliced: list[tuple[int, ...]],
    encode_first: Callable[[str], list[int]],
    encode_rest: Callable[[str], list[int]],
) -> Optional[list[int]]:
    """The prompt's ids with each placeholder replaced by its turn's tokens; None
    when the template did not keep every placeholder exactly once."""
    pieces = []
    rest = prompt
    for k in range(len(spliced)):
        mark = _MARK.format(k)
        if rest.count(mark) != 1:
            return None
        head, rest = rest.split(mark)
        pieces.append(head)
    if "\ue000" in rest:
        return None
    ids = encode_first(pieces[0]) if pieces else encode_first(rest)
    if not pieces:
        return ids
    ids = ids + list(spliced[0])
    for k in range(1, len(pieces)):
        ids += encode_rest(pieces[k]) + list(spliced[k])
    return ids + encode_rest(rest)
