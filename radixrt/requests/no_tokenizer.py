"""Serving without a tokenizer (SGLang's ``--skip-tokenizer-init``): token ids in, token ids out.

Clients that tokenize themselves (RL trainers' rollouts, routers that cache
token ids) start the server or the Engine with ``skip_tokenizer_init``: no
process loads a tokenizer, prompts come as ``input_ids``, and outputs carry
``output_ids`` and no ``text``, as SGLang's do.

`NoTokenizer` stands where the tokenizer would. Turning ids into text gives
"" (so the detokenizer and the stop checks run unchanged and see no text; the
OpenAI logprobs and the request log name ids instead: `has_text`); anything
that needs text from the tokenizer (a text prompt, a chat template) is refused
as a bad request naming the flag. Request fields that only mean something as text (stop strings, stop
regexes, grammars, text in logprobs) are refused at the front door by
`check_token_only`, never silently ignored.
"""

from __future__ import annotations

from typing import Any, NoReturn

from radixrt.requests.errors import RequestError

SKIPPED = "this runtime was started with skip_tokenizer_init (--skip-tokenizer-init), so it has no tokenizer"

# sampling_params fields that hold text, and why none can be served without a tokenizer
_STOP = "stops are matched against the output's text; stop_token_ids stop on token ids"
_GRAMMAR = "a grammar constrains the output's text through the tokenizer's vocabulary"
TEXT_SAMPLING_FIELDS = {
    "stop": _STOP,
    "stop_regex": _STOP,
    "regex": _GRAMMAR,
    "json_schema": _GRAMMAR,
    "ebnf": _GRAMMAR,
    "structural_tag": _GRAMMAR,
}


class TokenizerSkipped(RequestError, AttributeError):
    """What `NoTokenizer` raises for anything that needs text. A RequestError (400 on the server,
    ValueError on the Engine) and an AttributeError, so that ``getattr(tokenizer, name, default)``
    (the code's way to ask for an optional tokenizer feature) sees the feature missing."""


class NoTokenizer:
    """The tokenizer of a runtime started with ``skip_tokenizer_init`` (see the module docstring).
    Every attribute a Hugging Face tokenizer has and this class does not define raises
    `TokenizerSkipped`."""

    eos_token_id = None
    bos_token_id = None
    pad_token_id = None

    def encode(self, text: str, *args: Any, **kwargs: Any) -> NoReturn:
        raise TokenizerSkipped(f"{SKIPPED}: send the prompt as token ids ('input_ids'), not text")

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> str:
        return ""

    def get_vocab(self) -> dict[str, int]:
        return {}

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):  # copy, pickle and the like probe dunders: plainly missing
            raise AttributeError(name)
        raise TokenizerSkipped(f"{SKIPPED}: this request needs its {name!r} (text); send and read token ids")


def has_text(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` turns ids into text (False: a `NoTokenizer`)."""
    return not isinstance(tokenizer, NoTokenizer)


def check_token_only(sampling: Any, return_text_in_logprobs: bool) -> None:
    """RequestError naming the first field of a request that a runtime without a tokenizer cannot
    serve: text in ``sampling`` (`TEXT_SAMPLING_FIELDS`) or text asked for in its logprobs."""
    for name, why in TEXT_SAMPLING_FIELDS.items():
        if getattr(sampling, name):
            raise RequestError(f"{SKIPPED}: '{name}' cannot be served ({why})", name)
    if return_text_in_logprobs:
        raise RequestError(f"{SKIPPED}: logprobs come with token ids only", "return_text_in_logprobs")
