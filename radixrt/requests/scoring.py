"""Decoder-only scoring, SGLang's ``POST /v1/score`` and ``Engine.score``: how likely
each of a few label tokens is to come next after a query joined to each item.

Each item is one request: the query and the item joined (the query first unless
``item_first``), as text (tokenized together, as SGLang does) or as token ids. It
generates one greedy token and returns the logprobs of ``label_token_ids`` at that
next position (``token_ids_logprob``), so scoring is one prefill per item; with the
query first, the items share its KV through the radix tree. A score is the label's
probability under the model's whole next-token distribution, or, with
``apply_softmax``, its probability among the labels alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from radixrt.requests.errors import RequestError
from radixrt.requests.intake import Limits, PromptBatch, split_prompts
from radixrt.requests.token_id_lists import check_named_tokens, is_int

# What each item's request samples: the next token's distribution is all it is for.
SCORE_SAMPLING = {"max_new_tokens": 1, "temperature": 0.0}
# Joining repeats the query once per item: the joined prompts hold at most this many
# characters (or token ids) in all, whatever the body's size.
MAX_JOINED_UNITS = 1 << 22


@dataclass
class ScoreAsk:
    """The prompts of a scoring call (exactly one of ``texts`` and ``input_ids``, one per
    item) and what to read from their answers."""

    texts: Optional[list[str]]
    input_ids: Optional[list[list[int]]]
    label_token_ids: list[int]
    apply_softmax: bool


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(is_int(t) for t in value)


def score_ask(
    query: Any, items: Any, label_token_ids: Any, apply_softmax: Any = False, item_first: Any = False
) -> ScoreAsk:
    """The checked call: ``query`` a string with ``items`` a string or a list of strings,
    or ``query`` a list of token ids with ``items`` a list of such lists; at least one item;
    ``label_token_ids`` a non-empty list of token ids (their range and count are checked as
    ``token_ids_logprob``). RequestError naming the field otherwise."""
    for name, value in (("apply_softmax", apply_softmax), ("item_first", item_first)):
        if not isinstance(value, bool):
            raise RequestError(f"'{name}' must be a boolean.", name)
    if not _is_ids(label_token_ids) or not label_token_ids:
        raise RequestError("'label_token_ids' must be a non-empty list of token ids.", "label_token_ids")
    if isinstance(items, str):
        items = [items]
    if isinstance(query, str) and isinstance(items, list) and all(isinstance(i, str) for i in items):
        texts = True
    elif _is_ids(query) and isinstance(items, list) and all(_is_ids(i) for i in items):
        texts = False
    else:
        raise RequestError(
            "'query' must be a string with 'items' a string or a list of strings, or a list of token ids "
            "with 'items' a list of such lists.",
            "query" if not isinstance(query, (str, list)) else "items",
        )
    if not items:
        raise RequestError("'items' must hold at least one item.", "items")
    if len(query) * len(items) + sum(len(i) for i in items) > MAX_JOINED_UNITS:
        raise RequestError(
            f"the query joined to each of the {len(items)} items would hold more than {MAX_JOINED_UNITS} "
            f"{'characters' if texts else 'token ids'}; send fewer items per call",
            "items",
        )
    joined = [i + query if item_first else query + i for i in items]
    return ScoreAsk(
        texts=joined if texts else None,
        input_ids=None if texts else joined,
        label_token_ids=[int(t) for t in label_token_ids],
        apply_softmax=apply_softmax,
    )


def scores_of(results: list[dict], apply_softmax: bool) -> list[list[float]]:
    """Each item's label probabilities, in ``label_token_ids`` order, from its ``/generate``-shaped
    result (``meta_info.output_token_ids_logprobs`` of its one output token)."""
    scores = []
    for result in results:
        lps = [lp for lp, _, _ in result["meta_info"]["output_token_ids_logprobs"][0]]
        if apply_softmax:
            top = max(lps)
            exps = [math.exp(lp - top) for lp in lps]
            total = sum(exps)
            scores.append([e / total for e in exps])
        else:
            scores.append([math.exp(lp) for lp in lps])
    return scores


def score_prompts(ask: ScoreAsk, encode: Callable[[str], list[int]], limits: Limits) -> PromptBatch:
    """The items' prompts, tokenized and checked: the labels (at most ``max_top_logprobs_num``,
    each in the vocabulary), and what the call computes (`check_score_cost`)."""
    check_named_tokens(ask.label_token_ids, limits.max_top_logprobs_num, limits.vocab_size, "label_token_ids")
    prompts = split_prompts(ask.texts, ask.input_ids, encode, text_name="items", ids_name="items", limits=limits)
    check_score_cost(prompts.ids, limits.kv_total_slots)
    return prompts


def check_score_cost(prompts: list[list[int]], max_tokens: int) -> None:
    """RequestError unless the prompts need at most ``max_tokens`` computed (the KV pool's size),
    each sharing with the first the prefix they have in common, as the radix tree lets them: a
    long query joined after many items (``item_first``) is computed once per item."""
    first = prompts[0]
    total = len(first)
    for p in prompts[1:]:
        shared = 0
        for a, b in zip(p, first):
            if a != b:
                break
            shared += 1
        total += len(p) - shared
        if total > max_tokens:
            raise RequestError(
                f"scoring these {len(prompts)} items computes more than {max_tokens} prompt tokens (the KV "
                "pool's size; items share only the prefix they have in common): send fewer or shorter items, "
                "with the query first so that they share it",
                "items",
            )


def score_with(
    generate: Callable[..., Any],
    encode: Callable[[str], list[int]],
    limits: Limits,
    query: Any,
    items: Any,
    label_token_ids: Any,
    apply_softmax: Any,
    item_first: Any,
) -> list[list[float]]:
    """`score_ask` and `score_prompts`, run through ``generate`` (`Engine.generate`'s signature),
    read by `scores_of`."""
    ask = score_ask(query, items, label_token_ids, apply_softmax, item_first)
    prompts = score_prompts(ask, encode, limits)
    results = generate(None, dict(SCORE_SAMPLING), prompts.ids, token_ids_logprob=ask.label_token_ids)
    return scores_of(results, ask.apply_softmax)
