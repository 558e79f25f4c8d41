"""Reasoning separated from the answer, for models that think in
``<think>...</think>`` (Qwen3; ``--reasoning-parser qwen3``, or per request
``separate_reasoning``).

``split_reasoning(text, final)`` gives ``(reasoning, content)``. The thinking
block is the text up to ``</think>`` (a leading ``<think>`` removed); the
content is what follows, leading whitespace removed. Without ``</think>``:
an output that opened ``<think>`` is all reasoning (still thinking, or cut
off by the token limit), any other output is all content. While the output
grows (``final`` False), a tail that may become ``<think>``/``</think>`` is
held back.
"""

from __future__ import annotations

from radixrt.server.tools.scan import partial_suffix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek-r1")


def split_reasoning(text: str, final: bool = True) -> tuple[str, str]:
    body = text.lstrip()
    opened = body.startswith(THINK_OPEN)
    if opened:
        body = body[len(THINK_OPEN) :]
    end = body.find(THINK_CLOSE)
    if end >= 0:
        return body[:end].strip("\n"), body[end + len(THINK_CLOSE) :].lstrip()
    if opened:
        hold = 0 if final else partial_suffix(body, THINK_CLOSE)
        return body[: len(body) - hold].strip("\n"), ""  # trailing newlines wait: they may precede </think>
    if not final and THINK_OPEN.startswith(body):
        return "", ""  # may still open a thinking block
    return "", text
