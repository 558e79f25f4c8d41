"""How ``select`` picks a choice from per-token log-probabilities.

Each method receives, for every choice, the log-probabilities of the choice's
own tokens given the prompt (``input_token_logprobs``: lists of
``[logprob, token_id, text_or_None]``), their mean
(``normalized_prompt_logprobs``) and, for methods that ask for it, the
log-probabilities of the same tokens without the prompt
(``unconditional_token_logprobs``). It returns a :class:`ChoicesDecision`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def _lp(entry: Any, unknown: float = 0.0) -> float:
    """The logprob of one ``[logprob, token_id, text]`` entry (``unknown`` for None: a
    sequence's first token has none)."""
    v = entry[0] if isinstance(entry, (list, tuple)) else entry
    return unknown if v is None else float(v)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else -math.inf


def _argmax(scores: list[float]) -> int:
    best = 0
    for i, v in enumerate(scores):
        if v > scores[best]:
            best = i
    return best


class ChoicesSamplingMethod:
    requires_unconditional_logprobs = False
    name = "base"

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[Any]],
        output_token_logprobs: Optional[list[list[Any]]] = None,
        unconditional_token_logprobs: Optional[list[list[Any]]] = None,
    ) -> ChoicesDecision:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class TokenLengthNormalized(ChoicesSamplingMethod):
    """Pick the choice with the highest mean log-probability per token."""

    name = "token_length_normalized"

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs=None,
        unconditional_token_logprobs=None,
    ):
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(
            choices[best],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
            },
        )


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Walk the choices token by token, keeping at each position only the
    choices whose token there has the highest log-probability, until one is
    left. A choice shorter than the position compared is extended with its own
    mean log-probability so that length alone does not decide."""

    name = "greedy_token_selection"

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs=None,
        unconditional_token_logprobs=None,
    ):
        rows = [[_lp(e, unknown=-math.inf) for e in toks] for toks in input_token_logprobs]
        width = max((len(r) for r in rows), default=0)
        padded = []
        for r in rows:
            fill = _mean(r) if r else -math.inf
            padded.append(r + [fill] * (width - len(r)))
        alive = list(range(len(choices)))
        for j in range(width):
            top = max(padded[i][j] for i in alive)
            alive = [i for i in alive if padded[i][j] == top]
            if len(alive) == 1:
                break
        best = alive[0]
        return ChoicesDecision(
            choices[best],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
                "greedy_logprob_matrix": padded,
            },
        )


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """Pick the choice that the prompt makes most *more* likely than it is on
    its own: mean over the choice's tokens of
    ``logprob(token | prompt) - logprob(token | choice alone)``. This removes
    the bias towards choices that are likely anywhere (common words)."""

    name = "unconditional_likelihood_normalized"
    requires_unconditional_logprobs = True

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs=None,
        unconditional_token_logprobs=None,
    ):
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional_token_logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            c = [_lp(e) for e in cond]
            u = [_lp(e) for e in uncond]
            if not c:
                scores.append(-math.inf)
                continue
            u = (u + [0.0] * len(c))[: len(c)]
            scores.append(sum(a - b for a, b in zip(c, u)) / len(c))
        best = _argmax(scores)
        return ChoicesDecision(
            choices[best],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
                "unconditional_token_logprobs": unconditional_token_logprobs,
                "normalized_unconditional_prompt_logprobs": scores,
            },
        )


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
