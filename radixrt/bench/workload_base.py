"""What a workload of ``radixrt bench`` is made of: the `Workload` record,
the program and ``gen`` signatures, `Tokens` (text and chat blocks as token
ids) and `greedy` sampling. The workload builders (workloads.py,
agent_loop.py) import this module; it imports none of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from radixrt.bench.common import ReqResult

Gen = Callable[[list[int], dict, int], Awaitable[ReqResult]]
Program = Callable[[Gen], Awaitable[None]]


@dataclass
class Workload:
    name: str
    shape: str  # one line for the table header
    programs: list[Program]
    num_requests: int
    validate: Optional[Callable[[str], bool]] = None  # e.g. "is this valid JSON for the schema"
    params: dict[str, Any] = field(default_factory=dict)


class Tokens:
    """Turns text into token ids (no special tokens added) and draws random ids."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._markers: Optional[dict[str, tuple[str, str]]] = None

    def text(self, s: str) -> list[int]:
        return list(self.tokenizer.encode(s, add_special_tokens=False))

    def random(self, rng: random.Random, n: int) -> list[int]:
        hi = min(self.vocab_size, 40000)
        return [rng.randrange(100, hi) for _ in range(n)]

    def role(self, role: str, content: str = "", close: bool = True) -> list[int]:
        """A chat block as the model's template renders it (open only: ``close=False``)."""
        if self._markers is None:
            from radixrt.requests.chat_roles import derive_role_markers

            self._markers = derive_role_markers(self.tokenizer)
        pre, post = self._markers[role]
        return self.text(pre + content + (post if close else ""))

    def close(self, role: str) -> list[int]:
        if self._markers is None:
            self.role(role)
        return self.text(self._markers[role][1])


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
