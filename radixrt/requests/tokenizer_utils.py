"""Tokenizer loading and prompt building shared by the server's processes."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

# tokenizer_config.json classes that are the plain `tokenizer.json` tokenizer, whatever the model
_PLAIN_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_path: str) -> Any:
    """The model folder's tokenizer (the ModelRunner and the server's processes
    load the same). A folder whose ``tokenizer_config.json`` names the plain
    fast tokenizer loads that class directly: ``AutoTokenizer`` would also
    read the model's config through transformers' config classes, whose
    imports cost seconds of start-up. Any other class goes through ``AutoTokenizer``."""
    cfg_path = os.path.join(model_path, "tokenizer_config.json")
    plain = False
    if os.path.isfile(cfg_path) and os.path.isfile(os.path.join(model_path, "tokenizer.json")):
        with open(cfg_path, encoding="utf-8") as f:
            plain = json.load(f).get("tokenizer_class") in _PLAIN_FAST
    if plain:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_path)
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
