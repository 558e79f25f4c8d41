"""Lists of token ids a request gives: checks shared by the prompt and ``token_ids_logprob``.

``token_ids_logprob`` (SGLang's ``/generate`` field) names tokens whose
logprobs a request gets at every scored position, prompt and output alike,
whatever is sampled: a classifier's label tokens, say."""

from __future__ import annotations

import numbers
from typing import Any, Sequence

from radixrt.requests.errors import RequestError
from radixrt.sampling.params import SamplingParams


def is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def bad_token_ids(ids: Sequence[Any], vocab_size: int) -> list[Any]:
    """The entries of ``ids`` that are not token ids in ``[0, vocab_size)``."""
    rough = [t for t in ids if type(t) is not int or not 0 <= t < vocab_size]  # fast path: plain ints
    return [t for t in rough if not (is_int(t) and 0 <= t < vocab_size)]


def token_ids_each(value: Any, n: int, batch: bool) -> list[tuple[int, ...]]:
    """``token_ids_logprob`` for each of ``n`` prompts: a list of token ids (every
    prompt's), or for a ``batch`` a list of such lists (None entries: none); None: none."""
    if value is None:
        return [()] * n
    per_prompt = isinstance(value, list) and batch and any(isinstance(v, list) for v in value)
    values = value if per_prompt else [value] * n
    if len(values) != n:
        raise RequestError(f"'token_ids_logprob' has {len(values)} lists for {n} prompts.", "token_ids_logprob")
    out = []
    for v in values:
        if v is not None and not (isinstance(v, list) and all(is_int(t) for t in v)):
            raise RequestError(
                "'token_ids_logprob' must be a list of token ids (or, for a batch, one list per prompt).",
                "token_ids_logprob",
            )
        out.append(tuple(int(t) for t in v or ()))
    return out


def check_named_tokens(token_ids: Sequence[int], max_ids: int, vocab_size: int, field: str) -> None:
    """At most ``max_ids`` token ids (the server's --max-top-logprobs-num), each in the
    vocabulary: tokens whose logprobs a request names (RequestError naming ``field``)."""
    if len(token_ids) > max_ids:
        raise RequestError(
            f"{field} names {len(token_ids)} tokens; this server returns at most "
            f"{max_ids} per position (--max-top-logprobs-num)",
            field,
        )
    bad = bad_token_ids(token_ids, vocab_size)
    if bad:
        raise RequestError(f"{field} names ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", field)


def check_logprob_fields(
    top_logprobs_num: int,
    token_ids: Sequence[int],
    max_ids: int,
    vocab_size: int,
    sampling: SamplingParams,
    prompt_logprobs: bool = False,
) -> None:
    """``top_logprobs_num`` in ``[0, max_ids]`` (the server's --max-top-logprobs-num) and
    ``token_ids_logprob`` at most ``max_ids`` ids, each in the vocabulary; neither, nor
    ``prompt_logprobs`` (a ``logprob_start_len`` inside the prompt), with a beam search, whose
    outputs carry each token's own logprob but no per-position lists."""
    if top_logprobs_num < 0:
        raise RequestError("top_logprobs_num must be >= 0", "top_logprobs_num")
    if top_logprobs_num > max_ids:
        raise RequestError(
            f"top_logprobs_num is {top_logprobs_num}; this server returns at most "
            f"{max_ids} top logprobs per position (--max-top-logprobs-num)",
            "top_logprobs_num",
        )
    check_named_tokens(token_ids, max_ids, vocab_size, "token_ids_logprob")
    if sampling.beam_width > 1:
        asking = (("top_logprobs_num", top_logprobs_num), ("token_ids_logprob", token_ids))
        for name, asked in (*asking, ("logprob_start_len", prompt_logprobs)):
            if asked:
                raise RequestError(
                    f"{name} cannot be combined with beam_width > 1: a beam search returns each output "
                    "token's own logprob only",
                    name,
                )
