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


def check_token_ids_logprob(ids: Sequence[int], max_ids: int, vocab_size: int, sampling: SamplingParams) -> None:
    """At most ``max_ids`` ids (the server's --max-top-logprobs-num), each in the
    vocabulary; not with a beam search, whose outputs carry no per-position lists."""
    if not ids:
        return
    if len(ids) > max_ids:
        raise RequestError(
            f"token_ids_logprob names {len(ids)} tokens; this server returns at most "
            f"{max_ids} per position (--max-top-logprobs-num)",
            "token_ids_logprob",
        )
    bad = bad_token_ids(ids, vocab_size)
    if bad:
        raise RequestError(
            f"token_ids_logprob names ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", "token_ids_logprob"
        )
    if sampling.beam_width > 1:
        raise RequestError("token_ids_logprob cannot be combined with beam_width > 1", "token_ids_logprob")
