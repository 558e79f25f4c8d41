"""Reasoning separated from the answer, for models that think in
``<think>...</think>`` (``--reasoning-parser``, or per request
``separate_reasoning``), under SGLang's two rules:

* ``qwen3`` (and ``separate_reasoning`` without a server parser): the model
  opens the block itself. An output that starts with ``<think>`` thinks up
  to ``</think>``; any other output is all content, a ``</think>`` in it
  included;
* ``deepseek-r1``: the chat template opens the block in the prompt, so the
  output starts inside it (a leading ``<think>`` is still accepted) and
  thinks up to ``</think>``.

``reasoning_token_count`` gives how many output tokens the block took (usage's
``reasoning_tokens``). ``split_reasoning(text, final, opened_by_prompt)`` gives ``(reasoning,
content)``: the thinking block's text, and what follows ``</think>``
(leading whitespace removed). Inside a block that has not closed the output
is all reasoning (still thinking, or cut off by the token limit). While the
output grows (``final`` False), a tail that may become ``<think>`` or
``</think>`` is held back, so that streamed pieces never need taking back:
they add up to the split of the whole output.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek-r1")


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with
    (text to hold back while it may still become the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def opened_by_prompt(parser: str) -> bool:
    """Whether the parser's rule has the prompt open the thinking block (``deepseek-r1``)."""
    return parser == "deepseek-r1"


def reasoning_mode(separate: Optional[bool], parser: Optional[str]) -> str:
    """How a chat request's output is split: ``""`` (not at all), or the reasoning parser
    whose rule applies (``separate_reasoning`` asks for a split, ``--reasoning-parser`` names
    the rule; ``qwen3`` where only the request asks)."""
    if separate is False or (separate is None and not parser):
        return ""
    return parser or "qwen3"


def split_reasoning(text: str, final: bool = True, opened_by_prompt: bool = False) -> tuple[str, str]:
    body = text.lstrip()
    opened = body.startswith(THINK_OPEN)
    if opened:
        body = body[len(THINK_OPEN) :]
    elif not opened_by_prompt:
        if not final and THINK_OPEN.startswith(body):
            return "", ""  # may still open a thinking block
        return "", text
    end = body.find(THINK_CLOSE)
    if end >= 0:
        return body[:end].strip("\n"), body[end + len(THINK_CLOSE) :].lstrip()
    hold = 0 if final else max(partial_suffix(body, THINK_CLOSE), len(body) if THINK_OPEN.startswith(body) else 0)
    return body[: len(body) - hold].strip("\n"), ""  # trailing newlines wait: they may precede </think>


def reasoning_token_count(
    output_ids: Sequence[int],
    tokenizer: Any,
    mode: str,
    skip_special_tokens: Optional[bool] = None,
    text: Optional[str] = None,
) -> int:
    """How many of ``output_ids`` its thinking block took under ``mode``'s rule (`reasoning_mode`;
    "": no split, 0), the tokens that spell ``</think>`` included: all of them while the block has
    not closed, none where the output opened no block. Decoded as the output's text was
    (``skip_special_tokens``: None is true); at most about log2(len(output_ids)) decodes of a prefix.
    ``text``: the answer's text where a stop string cut it (what was split), else the ids' text."""
    if not mode or not output_ids:
        return 0

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens is not False)

    text = decode(output_ids) if text is None else text
    if not text.lstrip().startswith(THINK_OPEN) and not opened_by_prompt(mode):
        return 0
    if THINK_CLOSE not in text:
        return len(output_ids)
    lo, hi = 1, len(output_ids)  # the shortest prefix whose text holds </think>
    while lo < hi:
        mid = (lo + hi) // 2
        if THINK_CLOSE in decode(output_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo
