"""Tokens a request may not sample: ``allowed_token_ids`` and ``bad_words_ids``.

* ``allowed_token_ids`` (vLLM's): only these ids may be sampled (EOS included only if listed, as
  in vLLM: a request that lists none of the stop tokens ends at ``max_new_tokens``).
* ``bad_words_ids`` (transformers' name; vLLM's ``bad_words`` are tokenized into it on the OpenAI
  routes): sequences of ids that the output must not contain. A one-token sequence bans its
  token everywhere; a longer one bans its last token right after the output ends with the rest
  of it (vLLM's rule: the output's tokens, not the prompt's).

Both run in the sampler's stage 3 (logit_processing.py), with ``min_new_tokens``'s bans: a grammar
that allows only banned tokens wins, as it does over ``logit_bias``. Bounded: at most
`MAX_BAD_WORD_IDS` ids in all the sequences (each row checks every sequence each step), and the
allowed ids lie in the vocabulary. A request with a multi-token sequence needs each step's
token before the next is sampled, so it never runs under the overlap scheduler's step in flight.
This module imports no torch."""

from __future__ import annotations

from typing import Any, Optional

from radixrt.sampling.param_types import as_int_list, type_name

MAX_BAD_WORD_IDS = 4096


def read_allowed(value: Any) -> Optional[list[int]]:
    """``allowed_token_ids`` as a list of ints (None: every token)."""
    return None if value is None else as_int_list("allowed_token_ids", value)


def read_bad_words(value: Any) -> Optional[list[list[int]]]:
    """``bad_words_ids`` as a list of lists of ints (None: none)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"sampling parameter 'bad_words_ids' must be a list of lists of token ids, got {type_name(value)}"
        )
    return [as_int_list("bad_words_ids", seq) for seq in value]


def check_token_filters(
    allowed: Optional[list[int]], bad: Optional[list[list[int]]], vocab_size: Optional[int]
) -> None:
    """ValueError for an empty allowed list, an empty or over-long ban list, or an id outside the vocabulary."""
    if allowed is not None and not allowed:
        raise ValueError("sampling parameter 'allowed_token_ids' must not be empty: nothing could be sampled")
    if bad is not None:
        if any(not seq for seq in bad):
            raise ValueError("sampling parameter 'bad_words_ids' must not hold an empty sequence")
        total = sum(len(seq) for seq in bad)
        if total > MAX_BAD_WORD_IDS:
            raise ValueError(f"sampling parameter 'bad_words_ids' holds {total} ids; at most {MAX_BAD_WORD_IDS}")
    for name, ids in (("allowed_token_ids", allowed or []), ("bad_words_ids", [t for seq in bad or [] for t in seq])):
        for t in ids:
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                where = f" [0, {vocab_size})" if vocab_size is not None else ""
                raise ValueError(f"sampling parameter '{name}' has token id {t}, outside the vocabulary{where}")


def banned_now(bad: list[list[int]], output_ids: list[int]) -> list[int]:
    """The ids ``bad`` bans at the next position of an output that is ``output_ids`` so far."""
    banned = []
    for seq in bad:
        head = len(seq) - 1
        if head == 0 or (len(output_ids) >= head and output_ids[-head:] == seq[:-1]):
            banned.append(seq[-1])
    return banned


def needs_each_token(bad: Optional[list[list[int]]]) -> bool:
    """Its bans depend on the last tokens sampled (a sequence of more than one token)."""
    return bad is not None and any(len(seq) > 1 for seq in bad)
