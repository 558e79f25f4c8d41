"""vLLM's ``prompt_logprobs`` on /v1/completions (each choice's) and /v1/chat/completions (the
response's): for every prompt position, the logprob and rank of the prompt's token there, with
the ``k`` likeliest tokens at that position, as vLLM lists them::

    [None, {"1923": {"logprob": -3.2, "rank": 5, "decoded_token": " the"}, "11": {...}}, ...]

The first position is None (nothing precedes it). Keys are token ids; ``rank`` is 1 + the number
of tokens the model found likelier (the top entries' ranks are their places). The figures are
the prompt logprobs the scheduler computes for ``logprob_start_len`` 0 (raw logits, as every
logprob here), so the request computes its whole prompt instead of taking it from the cache."""

from __future__ import annotations

from typing import Any, Optional

from radixrt.requests.results import ResultAccumulator
from radixrt.server.token_texts import TokenTexts


def prompt_logprob_entries(acc: ResultAccumulator, k: int, tt: TokenTexts) -> list[Optional[dict[str, Any]]]:
    """vLLM's ``prompt_logprobs`` list of ``acc``'s prompt (with the ``k`` likeliest tokens)."""
    tops, ranks = acc.input_top_logprobs, acc.input_token_ranks
    out: list[Optional[dict[str, Any]]] = []
    for i, (lp, tid) in enumerate(acc.input_token_logprobs):
        if lp is None:
            out.append(None)
            continue
        rank = ranks[i] if i < len(ranks) else None
        entry = {str(tid): {"logprob": lp, "rank": rank, "decoded_token": tt(tid)}}
        for place, (value, top_id) in enumerate((tops[i] if i < len(tops) else None) or [], 1):
            if place > k:
                break
            entry.setdefault(str(top_id), {"logprob": value, "rank": place, "decoded_token": tt(top_id)})
        out.append(entry)
    return out
