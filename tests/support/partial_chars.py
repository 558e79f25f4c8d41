"""Prompts of ids that end inside a character, and the text an answer to one should read."""

from __future__ import annotations

from typing import Any


def cut_inside_a_character(tokenizer: Any) -> list[int]:
    """A prompt of ids that ends inside an emoji (the token of its first bytes), as a continuation
    cut at max_tokens can."""
    ids = tokenizer.encode("Pizza emoji: 🍕🍕🍕🍕", add_special_tokens=False)
    return ids[: next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))]


def completed_text(tokenizer: Any, prompt: list[int], output: list[int]) -> str:
    """The text of ``output`` after ``prompt``: the whole decode less the prompt's complete characters."""
    return tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt).rstrip("\ufffd")) :]
