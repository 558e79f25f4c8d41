"""Tokenizer loading and prompt building shared by the server's processes."""

from __future__ import annotations

import copy
import functools
import json
import os
from typing import Any, Optional, Sequence

from radixrt.requests.named_chat_templates import NAMED_CHAT_TEMPLATES
from radixrt.requests.no_tokenizer import NoTokenizer

# the files of which a folder holding a tokenizer has at least one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# tokenizer_config.json classes that are the plain `tokenizer.json` tokenizer, whatever the model
_PLAIN_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _plain_fast_config(model_path: str) -> Optional[dict]:
    """The folder's ``tokenizer_config.json`` when it names the plain fast tokenizer
    (the one whose whole behaviour is its ``tokenizer.json``), else None."""
    cfg_path = os.path.join(model_path, "tokenizer_config.json")
    if not (os.path.isfile(cfg_path) and os.path.isfile(os.path.join(model_path, "tokenizer.json"))):
        return None
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    return cfg if cfg.get("tokenizer_class") in _PLAIN_FAST else None


def _read_tokenizer(model_path: str) -> Any:
    if _plain_fast_config(model_path) is not None:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _folder_stamp(model_path: str) -> tuple:
    """What identifies the folder's files as they are now: each file's name, size and modification time."""
    with os.scandir(model_path) as entries:
        return tuple(sorted((e.name, st.st_size, st.st_mtime_ns) for e in entries if e.is_file() for st in [e.stat()]))


@functools.lru_cache(maxsize=4)
def _folder_tokenizer(real_path: str, stamp: tuple) -> Any:
    """The tokenizer of a folder as its files are (``stamp``), read once per process: reading one is
    about 0.4 s (transformers parses ``tokenizer.json`` in Python), which every Engine started in the
    same process would pay again. Shared read-only through `load_tokenizer`'s copies (a copy shares
    the Rust tokenizer, which encodes from several threads at once)."""
    return _read_tokenizer(real_path)


def load_tokenizer(model_path: Optional[str], chat_template: Optional[str] = None) -> Any:
    """The folder's tokenizer (the ModelRunner and the server's processes
    load the same), with ``chat_template`` (`read_chat_template`) in place of its own where given;
    a `NoTokenizer` for no folder (``skip_tokenizer_init``, `ModelSettings.tokenizer_source`).
    A folder whose ``tokenizer_config.json`` names the plain
    fast tokenizer loads that class directly: ``AutoTokenizer`` would also
    read the model's config through transformers' config classes, whose
    imports cost seconds of start-up. Any other class goes through ``AutoTokenizer``."""
    if model_path is None:
        return NoTokenizer()
    if os.path.isdir(model_path) and not any(os.path.exists(os.path.join(model_path, f)) for f in TOKENIZER_FILES):
        raise ValueError(
            f"{model_path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): give one with "
            "--tokenizer-path, or serve token ids only with --skip-tokenizer-init"
        )
    if os.path.isdir(model_path):
        # a copy: what the caller sets on it (the chat template below) stays its own
        tokenizer = copy.copy(_folder_tokenizer(os.path.realpath(model_path), _folder_stamp(model_path)))
    else:
        tokenizer = _read_tokenizer(model_path)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def is_inline_template(value: str) -> bool:
    """``value`` is a Jinja template itself (vLLM's --chat-template takes one), not a file's path."""
    return ("{{" in value or "{%" in value) and not os.path.isfile(value)


def read_chat_template(path: str) -> str:
    """The Jinja chat template in file ``path``: the file's text, or the ``chat_template`` of a
    JSON file (SGLang's --chat-template takes either), ``path`` itself when it is a template
    (`is_inline_template`, as vLLM takes it), or the template named ``path`` (`NAMED_CHAT_TEMPLATES`,
    where no file has that name). ValueError naming the flag otherwise, and
    when the template does not compile (a server's mistake, not every client's request's)."""
    if path in NAMED_CHAT_TEMPLATES and not os.path.isfile(path):
        text = NAMED_CHAT_TEMPLATES[path]
    elif is_inline_template(path):
        # as vLLM: escapes typed on a command line (\\n) are read as what they stand for
        text = path.encode("latin-1", "backslashreplace").decode("unicode_escape")
    elif not os.path.isfile(path):
        raise ValueError(
            f"chat_template {path!r} is not a file (a .jinja template, or a JSON file holding one), a template "
            f"or one of the names {', '.join(NAMED_CHAT_TEMPLATES)}"
        )
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith(".json"):
            text = json.loads(text).get("chat_template")
            if not isinstance(text, str):
                raise ValueError(f"chat_template {path!r} holds no 'chat_template' string")
    from jinja2 import TemplateError

    try:  # in the environment transformers renders it in (a private helper: without it, no check)
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return text
    try:
        _compile_jinja_template(text)
    except TemplateError as e:
        raise ValueError(f"chat_template {path!r} does not compile: {e}") from None
    return text


class TextDecoder:
    """Decoding only, straight on the `tokenizers` library: what the server's
    detokenizer process needs, without importing transformers (about 1.4 s of
    the process's CPU at every server start, measured). ``decode`` equals the transformers tokenizer's for the
    folders `load_decoder` gives it to (tests/unit/test_tokenizer_utils.py
    compares every id of the vocabulary)."""

    def __init__(self, backend: Any) -> None:
        self.backend_tokenizer = backend  # a tokenizers.Tokenizer

    def decode(
        self, token_ids: Sequence[int], skip_special_tokens: bool = False, spaces_between_special_tokens: bool = True
    ) -> str:
        # spaces_between_special_tokens only concerns slow (Python) tokenizers, as in transformers
        return self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def load_decoder(model_path: Optional[str]) -> Any:
    """What turns the folder's token ids into text: a `TextDecoder` where the
    tokenizer is the plain fast one and transformers' decode adds nothing to
    the backend's (no ``clean_up_tokenization_spaces``), else `load_tokenizer` (no folder: a `NoTokenizer`)."""
    if model_path is None:
        return NoTokenizer()
    cfg = _plain_fast_config(model_path)
    if cfg is None or cfg.get("clean_up_tokenization_spaces"):
        return load_tokenizer(model_path)
    from tokenizers import Tokenizer

    return TextDecoder(Tokenizer.from_file(os.path.join(model_path, "tokenizer.json")))


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


# apply_chat_template's and the tokenizer's own arguments: never template variables from a client
# (``chat_template`` among them would run the client's Jinja on the server)
TEMPLATE_CONTROL_KEYS = frozenset(
    "chat_template tokenize return_dict return_tensors return_assistant_tokens_mask tokenizer_kwargs padding "
    "truncation max_length add_generation_prompt continue_final_message conversation messages tools".split()
)


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
