"""A beam search's state (the search itself: beam.py).

Kept apart from beam.py so that the request (request.py), which points to its
search, imports this module and not the search, which imports the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from radixrt.requests.finish import FinishReason


@dataclass
class Hypothesis:
    """A finished (or, when the search was cut short, the best live) sequence."""

    output_ids: list[int]
    logprob: float  # cumulative log-probability of its tokens
    score: float  # logprob / len(output_ids) ** length_penalty
    finish_reason: FinishReason
    token_logprobs: list[float]


@dataclass(eq=False)
class BeamGroup:
    """One beam request's search state. ``beams``: the live hypotheses in score
    order (each a `Req` whose ``beam`` is this group); ``finished``: at most
    ``width`` hypotheses, best first."""

    rid: str
    out_rids: list[str]  # the ids its n outputs are sent under
    width: int
    length_penalty: float
    early_stopping: Union[bool, str]
    max_new_tokens: int
    candidates_per_beam: int
    return_logprob: bool
    prompt_tokens: int
    beams: list[Any] = field(default_factory=list)  # the live hypotheses: scheduler.request.Req
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True  # transformers' early-stop heuristic has not closed the search yet
    ended: bool = False
    requeue: bool = False  # a fork found no memory: the whole search goes back to waiting (`_requeue`)
    steps: int = 0
    forks: int = 0
    copied_slots: int = 0  # KV slots copied on write (partly filled pages)
    retractions: int = 0  # times the search went back to waiting (its beams count them, children inherit)
    peak_kv_slots: int = 0  # the most distinct KV slots its live beams held at once
    next_id: int = 1

    def ready(self) -> bool:
        """Every live beam has its continuations: the search can take its next step."""
        return all(b.beam_candidates is not None for b in self.beams)

    def describe(self, rank: int, hyp: Hypothesis) -> dict[str, Any]:
        return {
            "rank": rank,
            "score": hyp.score,
            "cumulative_logprob": hyp.logprob,
            "width": self.width,
            "steps": self.steps,
            "forks": self.forks,
            "copied_slots": self.copied_slots,
            "peak_kv_slots": self.peak_kv_slots,
        }
