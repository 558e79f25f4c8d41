"""One request's speculative-decoding state (see speculative.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixrt.memory.draft_index import OwnTokens

DECAY = 0.7  # weight of a request's earlier verifications in its acceptance estimate
PRIOR_ACCEPTED, PRIOR_REJECTED = 1.0, 1.0  # a new request's estimate: p = 0.5


@dataclass
class SpecState:
    """One request's speculation: its own tokens indexed, its acceptance
    estimate, and what it reports (``spec_verify_ct``: its decode steps since
    it started speculating, each verifying a draft, possibly empty)."""

    own: "OwnTokens"
    synced: int  # tokens of input_ids + output_ids already in ``own``
    accepted: float = PRIOR_ACCEPTED  # decayed counts of accepted / rejected draft positions
    rejected: float = PRIOR_REJECTED
    verify_ct: int = 0
    drafted: int = 0  # draft tokens verified, and accepted, over its life
    kept: int = 0

    @property
    def p(self) -> float:
        return self.accepted / (self.accepted + self.rejected)
