"""Jump-forward drafts adapt their length per request (scheduler/constrained.py):
a draft the model does not follow shrinks the next one to what was kept, a
draft kept whole doubles it, within [1, MAX_DRAFT_TOKENS]."""

from __future__ import annotations

from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.constrained import MAX_DRAFT_TOKENS, ConstrainedDecoding
from radixrt.scheduler.request import Req


def test_draft_limit_shrinks_on_rejection_and_doubles_on_acceptance():
    req = Req(rid="r", input_ids=[3, 4], sampling=SamplingParams(max_new_tokens=8), seed=0)
    assert req.draft_limit is None  # the first draft may be as long as MAX_DRAFT_TOKENS
    limits = []
    for proposed, kept in ((40, 3), (3, 3), (6, 6), (12, 0), (1, 1), (2, 2), (200, 200), (256, 256)):
        ConstrainedDecoding.next_draft_limit(req, proposed, kept)
        limits.append(req.draft_limit)
    assert limits == [3, 6, 12, 1, 2, 4, 400 if MAX_DRAFT_TOKENS > 400 else MAX_DRAFT_TOKENS, MAX_DRAFT_TOKENS]
