"""A module's in-process Engine on the tiny random Llama, and greedy sampling parameters."""

from __future__ import annotations

from typing import Any

import pytest

import radixrt


def greedy(tokens: int, **extra: Any) -> dict:
    """Greedy sampling of exactly ``tokens`` tokens."""
    return {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True, **extra}


def tiny_engine_fixture(**flags: Any) -> Any:
    """A module-scoped fixture: an Engine on ``tiny_llama`` with 8,192 KV tokens and ``flags``."""

    @pytest.fixture(scope="module")
    def engine(tiny_llama: str) -> Any:
        e = radixrt.Engine(tiny_llama, max_total_tokens=8192, **flags)
        yield e
        e.shutdown()

    return engine
