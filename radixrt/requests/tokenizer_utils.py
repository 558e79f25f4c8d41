"""Tokenizer loading and prompt building shared by the server's processes."""

from __future__ import annotations

from typing import Any, Optional


def load_tokenizer(model_path: str) -> Any:
    """The same tokenizer the scheduler's ModelRunner loads."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    extra: Optional[dict] = None,
) -> str:
    """The chat prompt as text (special tokens written out), ready for `encode`."""
    kwargs = dict(extra or {})
    if continue_final_message:
        kwargs["continue_final_message"] = True
        add_generation_prompt = False
    if getattr(tokenizer, "chat_template", None) is None:
        # A base model without a template: a plain transcript.
        lines = [f"{m['role']}: {m.get('content') or ''}" for m in messages]
        text = "\n".join(lines)
        if add_generation_prompt:
            text += "\nassistant:"
        return text
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
